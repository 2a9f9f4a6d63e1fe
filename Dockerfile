# fairgate's image: `docker build -t fairgate:dev .` (docker-compose.yml builds it too).
# Two stages: wheels are built in the first, and the second installs them without a compiler, pip's cache or
# the sources; it runs as an unprivileged user, answers its health check on /ready, and drains on SIGTERM
# (drain_s, 30 s: compose's stop_grace_period leaves it that long before a SIGKILL).

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fairgate ./fairgate
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels fairgate && rm -rf /wheels \
 && groupadd --system --gid 10001 fairgate \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/fairgate fairgate
USER fairgate
WORKDIR /home/fairgate
ENV PYTHONUNBUFFERED=1 FAIRGATE_HOME=/home/fairgate
EXPOSE 8080
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8080/ready', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
CMD ["fairgate", "serve", "--host", "0.0.0.0"]
