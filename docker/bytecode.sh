#!/bin/sh
# Keeps the bytecode of what edge-un runs and drops the rest; runs in the image's builder stage
# only (docker/Dockerfile), after docker/slim.sh:   bytecode.sh /opt/edge-un
#
# pip compiles every module it installs: 289 MB of __pycache__ in the main environment, most
# of it for modules edge-un never imports (transformers' hundreds of architectures, sympy,
# scipy, the tests of other packages...). Here every __pycache__ goes, then edge-un's own
# commands run once, as root, so that Python writes back the bytecode of exactly the modules
# they import: a conversion for every target this image builds, a Hugging Face model, a report,
# report.html, a token (which migrates the service's database) and the modules of `serve` and
# `worker`. What stays is about 120 MB. A module outside that set (another Hugging Face
# architecture, `edge-un train`) is compiled in memory when first imported, a fraction of a
# second each: the container's users cannot write the image's files, so it is not cached.
# This is also the build's smoke test: a conversion that fails fails the build.
set -eu
venv=$1
site=$(echo "$venv"/lib/python3.*/site-packages)
find "$site" -name __pycache__ -prune -exec rm -rf {} +

work=$(mktemp -d)
cd "$work"
export HOME="$work" EDGE_UN_DATA_DIR="$work/data" OMP_NUM_THREADS=2
edge-un --help >/dev/null
edge-un targets >/dev/null
edge-un convert -o out >convert.log 2>&1 || { cat convert.log; exit 1; }
edge-un convert hf-bert-rt-un --target cpu -o out-hf >convert-hf.log 2>&1 \
    || { cat convert-hf.log; exit 1; }
edge-un report out >/dev/null
edge-un token create build >/dev/null 2>&1
python - <<'END'
from pathlib import Path

import service.server.app
import service.worker.celery_app
import service.server.serve
import service.worker.job_process
from quant.report import Report
from service.report_html import render_report_html

render_report_html(Report.read(Path("out/report.json")))
END
cd /
rm -rf "$work"
chmod -R a+rX "$venv"
echo "bytecode.sh: $(find "$site" -name __pycache__ -prune -print0 | du -scm --files0-from=- \
    | tail -1 | cut -f1) MB of __pycache__ kept in $venv"
