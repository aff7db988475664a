#!/usr/bin/env bash
# Makes sure Redis (6379), PostgreSQL (5432) and RabbitMQ (5672) answer on 127.0.0.1: starts any that is
# installed but down, and installs a missing one from Debian packages when run as root.
# With CI set, a service that cannot be brought up is an error; locally it is a warning (its tests skip).
set -uo pipefail

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # name port seconds
  local i
  for ((i = 0; i < $3; i++)); do
    if answers "$2"; then echo "services: $1 answers on 127.0.0.1:$2"; return 0; fi
    sleep 1
  done
  echo "services: $1 does not answer on 127.0.0.1:$2" >&2
  return 1
}

apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "services: cannot install $* (needs root and apt-get)" >&2
    return 1
  fi
  [ -n "${APT_UPDATED:-}" ] || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && APT_UPDATED=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

redis() {
  answers 6379 && { echo "services: redis answers on 127.0.0.1:6379"; return 0; }
  command -v redis-server >/dev/null || apt_install redis-server || return 1
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for redis 6379 30
}

postgres() {
  answers 5432 && { echo "services: postgres answers on 127.0.0.1:5432"; return 0; }
  if [ ! -d /etc/postgresql ] || [ -z "$(ls /etc/postgresql)" ]; then
    apt_install postgresql || return 1
    # A fresh Debian cluster asks for passwords on TCP; the tests connect as postgres with trust auth.
    local hba
    hba=$(ls /etc/postgresql/*/main/pg_hba.conf | head -1)
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
  wait_for postgres 5432 60
}

rabbitmq() {
  answers 5672 && { echo "services: rabbitmq answers on 127.0.0.1:5672"; return 0; }
  command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server || return 1
  rabbitmq-server -detached
  wait_for rabbitmq 5672 120
}

failed=0
for service in redis postgres rabbitmq; do
  "$service" || failed=1
done
if [ "$failed" != 0 ]; then
  if [ -n "${CI:-}" ]; then
    echo "services: a service is missing and CI is set: stopping" >&2
    exit 1
  fi
  echo "services: continuing; the tests that need a missing service will skip" >&2
fi
exit 0
