"""``reference/configuration.md`` from ``fairgate.proxy.config``: every key of ``GatewayConfig`` and of its
nested sections, the environment variables ``load_config`` reads, and the default configuration as YAML."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing

from gen.text import cell, clean, code, link_docs, yaml_value


def _field_comments(cls) -> dict[str, str]:
    """Each field's comment: the comment on its line(s), else the comment block just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above, n = [], node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments.get(n, ""))
            n -= 1
        out[node.target.id] = " ".join(above + trailing)
    return out


def _allowed_values(module) -> dict[str, list[str]]:
    """Allowed values of the keys that ``GatewayConfig.validate`` checks with ``x not in (...)``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(module.GatewayConfig.validate)))
    alias = {"self": ""}  # local names bound to a nested section, e.g. fs = self.fairserve
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"):
            alias[node.targets[0].id] = node.value.attr + "."
    allowed: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.NotIn)):
            continue
        left, right = node.left, node.comparators[0]
        if not (isinstance(left, ast.Attribute) and isinstance(left.value, ast.Name) and left.value.id in alias):
            continue
        if isinstance(right, ast.Name):
            values = getattr(module, right.id, None)
        elif isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            values = [e.value for e in right.elts if isinstance(e, ast.Constant)]
        else:
            values = None
        if values:
            key = alias[left.value.id] + left.attr
            # the narrowest check wins (placement: every name is known, only the built ones are accepted)
            if key not in allowed or len(values) < len(allowed[key]):
                allowed[key] = [str(v) for v in values]
    return allowed


def _environment(module) -> list[tuple[str, str]]:
    """(variable, what it sets) for every FAIRGATE_* variable ``load_config`` reads: its ``ENVIRONMENT`` table
    (variable → key), pairs written in its body, and the variable naming the file."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(module.load_config)))
    env: list[tuple[str, str]] = [(name, f"`{key}`") for name, key in getattr(module, "ENVIRONMENT", ())]
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            name, key = (e.value for e in node.elts)
            if name.startswith("FAIRGATE_") and all(name != n for n, _ in env):
                env.append((name, f"`{key}`"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("FAIRGATE_")
                and all(node.args[0].value != n for n, _ in env)):
            env.insert(0, (node.args[0].value, "the YAML file to read (when `--config` is not given)"))
    return env


def _sections(module):
    """(prefix, dataclass, description) of the top level and each nested section, in field order."""
    top = module.GatewayConfig
    out = [("", top, "The top level of the file.")]
    hints = typing.get_type_hints(top, vars(module))
    for f in dataclasses.fields(top):
        t = hints[f.name]
        inner = [a for a in typing.get_args(t) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(t):
            doc = t.__doc__ or ""
            if doc.startswith(t.__name__ + "("):  # the signature dataclasses write when there is no docstring
                doc = SECTION_FALLBACK.get(f.name, "")
            out.append((f.name + ".", t, clean(doc)))
        elif inner:
            out.append((f.name + "[].", inner[0], "Each entry of the list (a bare string is taken as its `url`)."))
    return out


def _section_id(prefix: str) -> str:
    return prefix.rstrip(".").replace("[]", "").replace(".", "-") or "top-level"


# For the keys whose field carries no comment in the code: what the key does, in a sentence (the code's own
# comment, when one is added, takes precedence over these).
FALLBACK = {
    "host": "address the gateway listens on",
    "port": "port the gateway listens on (the OpenAI API, and /metrics unless `ops_port` is set)",
    "database_url": "SQL database for identity, settings, the usage log and the audit (`sqlite://` and "
                    "`postgresql://` URLs are given their async drivers)",
    "max_body_bytes": "largest request body accepted (413 beyond)",
    "tokenizer": "tiktoken encoding that counts prompts before dispatch, for models not in `tokenizers`",
    "health_interval_s": "how often each backend's /v1/models and /metrics are probed",
    "connect_timeout_s": "to open a connection to a backend",
    "retry_after_s": "the `retry-after` of a 503 when no backend can take a request",
    "identity_cache_ttl_s": "how long a key lookup is cached (a revoked key stops working within this and one "
                            "lookup; while the database is down a known key keeps its last answer)",
    "queue_timeout_s": "longest wait in the fair queue, then 503 with retry-after",
    "ops_host": "address of `ops_port`'s listener",
    "backends[].url": "the backend's base URL, http:// or https://",
    "backends[].name": "its name in metrics and usage rows (default: from the URL)",
    "backends[].max_num_seqs": "requests it runs at once, vLLM's --max-num-seqs (None: read from "
                                "vllm:cache_config_info)",
    "emulated.count": "emulated backends started in-process when `backends` is empty",
    "emulated.model": "the model name they serve",
    "emulated.profile": "engine profile: a10g-llama2-7b, a10g-llama3-3b or a100-llama2-13b",
    "emulated.speed": "how many times faster than the profile's real time",
    "emulated.kv_tokens": "KV capacity (None: the profile's)",
    "emulated.max_num_seqs": "requests each runs at once (None: the profile's)",
    "emulated.mean_output": "mean output length of a request without `ignore_eos`",
    "emulated.admission": "`future`: a request is admitted when its whole future fits, so none is ever "
                          "preempted; `vllm`: when its prompt fits now, preempting the last admitted when a "
                          "step lacks room, as vLLM v1 does",
}
SECTION_FALLBACK = {
    "emulated": "The emulated vLLM backends the gateway starts in-process when `backends` is empty "
                "(`make run`'s default).",
}


# Code names in the fields' comments, said in words on the page.
REWORD = {"journal_path()": "one per database and port in the data directory",
          "data_dir()": "the data directory"}
NOT_SETTINGS = ("sources",)  # fields of GatewayConfig that a file may not set (load_config fills them)


def describe(text: str) -> str:
    text = clean(text)
    for name, words in REWORD.items():
        text = text.replace(name, words)
    return text


def _in_data_dir(value) -> bool:
    """A default computed from the data directory of the machine that builds the site (its home directory)."""
    from fairgate.storage.db import data_dir

    return isinstance(value, str) and str(data_dir()) in value


def _type(t, f) -> str:
    """A field's type as readable text: `int` or `None`, `list[str]`."""
    text = t.__name__ if isinstance(t, type) else str(f.type)
    return " or ".join(code(part.strip()) for part in text.split(" | "))


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def config_page() -> str:
    from fairgate.proxy import config as module

    allowed = _allowed_values(module)
    lines = [
        "# Configuration reference",
        "",
        "!!! note \"Generated\"",
        "    This page is generated when the site is built, from the configuration dataclasses in",
        "    `fairgate/proxy/config.py` (types and defaults from the fields, descriptions from their",
        "    comments, allowed values from `validate()`). Change the code, not this page.",
        "",
        "## Where settings come from",
        "",
        "Each layer overrides the one before it:",
        "",
        "1. the defaults below;",
        "2. the YAML file given with `fairgate serve --config FILE`, else the one named by `$FAIRGATE_CONFIG`;",
        "3. the environment variables below;",
        "4. the command-line flags of [`fairgate serve`](cli.md#fairgate-serve);",
        "5. the database: the live settings an admin stored with `fairgate admin policy set`,",
        "   `admin locality set` and `placement`, and `admin fairserve set` (the policy, the placement, the",
        "   `locality.*` parameters and FairServe's run-time settings). They reach every gateway on the database",
        "   within `settings_refresh_s` and win over all of the above, at run time and at every start, until",
        "   `fairgate admin policy unset` (`locality unset`, `fairserve unset`) hands them back. See",
        "   [configuring](../operations/configuration.md#the-layers).",
        "",
        "A key the configuration does not know is an error, in the file and in every nested section, and so is",
        "a value `validate()` refuses: the gateway does not start on a configuration it would misread.",
        "",
        "## Environment variables",
        "",
        "| variable | sets |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {what} |" for name, what in _environment(module)]
    lines += ["", "The CLI's commands read some variables of their own (`FAIRGATE_ACTOR`, for instance): the",
              "[CLI reference](cli.md) lists each option's variable.", ""]
    lines += [
        "## The data directory {#the-data-directory}",
        "",
        "The default SQLite database (`fairgate.db`), the usage journal and the dead-letter file live in one",
        "directory, whatever the working directory: `$FAIRGATE_HOME`, else `$XDG_DATA_HOME/fairgate`, else",
        "`~/.local/share/fairgate` (`data_dir()` in `fairgate/storage/db.py`). So an admin command run from",
        "another directory reads the gateway's database instead of creating an empty one. `database_url`,",
        "`usage_journal` and `usage_dead_letter` name other places.",
        "",
    ]
    for prefix, cls, about in _sections(module):
        comments = _field_comments(cls)
        hints = typing.get_type_hints(cls, vars(module))
        title = "Top level" if not prefix else f"`{prefix.rstrip('.')}`"
        lines += [f"## {title} {{#{_section_id(prefix)}}}", ""]
        if about:
            lines += [link_docs(about), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if not prefix and f.name in NOT_SETTINGS:
                continue
            t = hints[f.name]
            default = _default(f)
            if default is dataclasses.MISSING:
                shown = "*required*"
            elif _in_data_dir(default):
                shown = "`fairgate.db` in the [data directory](#the-data-directory)"
            elif dataclasses.is_dataclass(default):
                shown = f"see [`{prefix}{f.name}`](#{_section_id(prefix + f.name)})"
            elif isinstance(default, list) and not default and any(
                    dataclasses.is_dataclass(a) for a in typing.get_args(t)):
                shown = f"`[]`, see [`{f.name}[]`](#{_section_id(prefix + f.name)})"
            else:
                shown = code(yaml_value(default))
            desc = cell(describe(comments.get(f.name) or FALLBACK.get(prefix + f.name, "")))
            desc = desc[:1].upper() + desc[1:]
            if desc and desc[-1] not in ".;:!?)":
                desc += "."
            if (prefix + f.name) in allowed:
                desc += (" " if desc else "") + "One of: " + ", ".join(code(v) for v in allowed[prefix + f.name]) + "."
            lines.append(f"| `{prefix}{f.name}` | {_type(t, f)} | {shown} | {desc} |")
        lines.append("")
        if not prefix:
            lines += [", ".join(f"`{n}`" for n in NOT_SETTINGS) + " is not a setting: `load_config` records "
                      "in it where each key came from (what the `show` commands print), and a file that names "
                      "it is refused.", ""]
    lines += [
        "## The defaults as a file",
        "",
        "Every key at its default, as `fairgate serve --config` reads it (comments from the code):",
        "",
        "```yaml",
        *_default_yaml(module),
        "```",
        "",
    ]
    return "\n".join(lines)


def _default_yaml(module) -> list[str]:
    def render(cls, indent: str, prefix: str = "") -> list[str]:
        comments = _field_comments(cls)
        hints = typing.get_type_hints(cls, vars(module))
        out = []
        for f in dataclasses.fields(cls):
            default = _default(f)
            if not prefix and f.name in NOT_SETTINGS:
                continue
            comment = describe(comments.get(f.name) or FALLBACK.get(prefix + f.name, ""))
            if _in_data_dir(default):  # not this machine's home directory: the line a reader would write
                out.append(f"{indent}# {f.name}: sqlite:///<the data directory>/fairgate.db   (the default)")
                continue
            if dataclasses.is_dataclass(default):
                out.append(f"{indent}{f.name}:" + (f"  # {comment}" if comment else ""))
                out += render(type(default), indent + "  ", prefix + f.name + ".")
                continue
            if default is dataclasses.MISSING:
                continue
            if isinstance(default, list) and not default and any(
                    dataclasses.is_dataclass(a) for a in typing.get_args(hints[f.name])):
                comment = (comment + "; " if comment else "") + "each: {url, name, models, kv_tokens, …}"
            line = f"{indent}{f.name}: {yaml_value(default)}"
            out.append(f"{line:<44} # {comment}" if comment else line)
        return out

    return render(module.GatewayConfig, "")
