"""Limits and budgets (docs/operations/limits.md): what a request is held to and what it spent.

- ``meters``: a limit or a budget as a meter a request reserves on, draws from and settles (pure);
- ``plans``: which meters a request's app, user and key hold it to, and what it reserved (pure);
- ``stores``: where the meters live on one process; ``redis_store``: across the replicas (one Lua script);
- ``quota_admin``: limits, budgets and prices in SQL (``fairgate admin limit|budget|price``);
- ``spend``: what the usage log says was spent (a budget's meter is seeded from it; ``fairgate usage spend``).

The request's stage that runs them is the quota gate, ``proxy/pipeline/quota_gate.py``.
"""
