#!/usr/bin/env bash
# Makes sure promtool (Prometheus's rule checker, from Debian's prometheus package) is installed, for the
# tests of contrib/prometheus/celery-guardrails-rules.yml: installed when run as root. With CI set, failing to
# get it is an error; locally those tests skip. (Installing the package does not start a Prometheus server
# where policy-rc.d forbids starting services, as in containers; elsewhere its unit may start on :9090.)
set -uo pipefail
if command -v promtool >/dev/null; then
  echo "promtool: $(command -v promtool) is there"
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
if command -v promtool >/dev/null; then
  echo "promtool: installed $(command -v promtool)"
  exit 0
fi
echo "promtool: not installed (needs root and apt-get); the Prometheus rules tests that run it will skip" >&2
[ -z "${CI:-}" ]
