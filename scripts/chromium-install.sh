#!/usr/bin/env sh
# Debian's chromium for the console's browser test (tests/browser.py), installed if missing; under a lock, so
# `make test` can start it in the background and the test wait for it.
exec flock /tmp/fairgate-chromium.lock sh -c 'command -v chromium >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }'
