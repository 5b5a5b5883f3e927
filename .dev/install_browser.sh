#!/usr/bin/env bash
# Headless Chromium for tests/test_browser.py: Debian's chromium, driven by PyPI playwright.
# Idempotent: installs only what is missing. (`playwright install` cannot download browsers here.)
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
  export DEBIAN_FRONTEND=noninteractive
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  $sudo_ apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
python=${PYTHON:-python}  # the project's venv python: activate the venv first, or set PYTHON
if ! "$python" -c "import playwright.sync_api" 2>/dev/null; then
  "$python" -m pip install --quiet playwright
fi
/usr/bin/chromium --version 2>/dev/null
