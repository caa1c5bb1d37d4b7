#!/usr/bin/env bash
# `make run`: serve on 127.0.0.1:8080 against QS_REDIS_URL when set; otherwise against a durable
# redis-server started here (data under ./var, appendonly on); otherwise in memory, loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p var
py=.venv/bin/python
if [ -z "${QS_ADMIN_TOKEN:-}" ]; then
  [ -s var/admin-token ] || "$py" -c 'import secrets; print("qsadmin_" + secrets.token_urlsafe(32))' > var/admin-token
  QS_ADMIN_TOKEN=$(cat var/admin-token)
  export QS_ADMIN_TOKEN
fi
if [ -n "${QS_REDIS_URL:-}" ]; then
  where="the Redis at $QS_REDIS_URL"
elif command -v redis-server >/dev/null 2>&1; then
  port=${QS_LOCAL_REDIS_PORT:-6380}
  if ! redis-cli -p "$port" ping >/dev/null 2>&1; then
    redis-server --port "$port" --bind 127.0.0.1 --dir "$PWD/var" --daemonize yes \
      --pidfile "$PWD/var/redis.pid" --logfile "$PWD/var/redis.log" \
      --appendonly yes --appendfsync everysec --save "" \
      --notify-keyspace-events Ex --maxmemory-policy noeviction
    for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  export QS_REDIS_URL="redis://127.0.0.1:$port/0"
  where="a local redis-server on port $port (data in ./var, stop it: redis-cli -p $port shutdown)"
else
  export QS_REDIS_URL=memory://
  where="MEMORY ONLY: no redis-server found (Debian: apt-get install redis-server); NOTHING IS KEPT"
fi
port=${QS_PORT:-8080}
cat <<MSG

  Question Service on http://127.0.0.1:$port using $where
  Admin token (QS_ADMIN_TOKEN): $QS_ADMIN_TOKEN

  Create the first agent and user (each reply shows its token once):
    curl -s -X POST localhost:$port/v1/admin/principals -H "Authorization: Bearer $QS_ADMIN_TOKEN" \\
         -H 'Content-Type: application/json' -d '{"id": "deploybot", "kind": "agent"}'
    curl -s -X POST localhost:$port/v1/admin/principals -H "Authorization: Bearer $QS_ADMIN_TOKEN" \\
         -H 'Content-Type: application/json' -d '{"id": "alice", "kind": "user"}'
  Then follow the walk-through in README.md.

MSG
exec "$py" -m service serve
