#!/usr/bin/env bash
# Headless Chromium for tests/test_browser.py: Debian's chromium, driven by PyPI playwright.
# Idempotent: installs Chromium only when it is missing. (`playwright install` cannot download browsers here.)
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
  echo "== installing Debian's chromium for the browser test (once)"
  export DEBIAN_FRONTEND=noninteractive
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq
  $sudo_ apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
python=${PYTHON:-python}  # the project's venv python: activate the venv first, or set PYTHON
# playwright itself is a pinned dev dependency (.dev/requirements.lock), installed with the rest
"$python" -c "import playwright.sync_api" || { echo "playwright is missing from $python's environment: make install"; exit 1; }
/usr/bin/chromium --version 2>/dev/null
