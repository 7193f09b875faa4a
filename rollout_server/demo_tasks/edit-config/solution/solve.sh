#!/bin/bash
# Edit only the [server] section: its port and debug lines.
set -euo pipefail
cd /app
sed -i '/^\[server\]/,/^\[/{s/^port = 8000$/port = 9090/;s/^debug = true$/debug = false/}' service.ini
