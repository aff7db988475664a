#!/usr/bin/env bash
# Makes sure the system Chromium the admin's browser tests drive (through Playwright, which downloads no
# browser) is installed: Debian's chromium package, when run as root. With CI set, failing to get it is an
# error; locally the browser tests skip.
set -uo pipefail
if [ -x /usr/bin/chromium ]; then
  echo "browser: /usr/bin/chromium is there"
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if [ -x /usr/bin/chromium ]; then
  echo "browser: installed /usr/bin/chromium"
  exit 0
fi
echo "browser: no /usr/bin/chromium (needs root and apt-get); the browser tests will skip" >&2
[ -z "${CI:-}" ]
