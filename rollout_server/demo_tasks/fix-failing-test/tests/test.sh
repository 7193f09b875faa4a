#!/bin/bash
# Grades /app/stats.py on held-out cases the agent never saw. The agent's code runs
# only in cases.py's own process, as an unprivileged user, and never decides the
# reward: check.py, run as root, compares what that process printed with its own
# answers. /tests is root's alone, so the runner gets a readable copy.
mkdir -p /logs/verifier
work=$(mktemp -d)
cp /tests/cases.py "$work/" && chmod 755 "$work" && chmod 644 "$work/cases.py"
if id agent >/dev/null 2>&1; then
  as_agent=(runuser -u agent --)
elif [ "$(id -u)" = 0 ]; then
  as_agent=(setpriv --reuid=65534 --regid=65534 --clear-groups)  # nobody, where no agent user exists
else
  as_agent=()  # an ordinary user's local sandbox: nothing to drop
fi
cd "$work" && "${as_agent[@]}" timeout 20 python3 -I "$work/cases.py" /app 2>/logs/verifier/cases.log \
  | head -c 100000 > /logs/verifier/observed.txt
python3 /tests/check.py /logs/verifier/observed.txt > /logs/verifier/reward.json
