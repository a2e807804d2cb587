# sourced by each call: unpack the builds into /tmp/bins/<build>/, fla wheels, library path
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
rm -rf /tmp/bins /tmp/bund_*; mkdir -p /tmp/bins
for b in .dev/b14 .dev/b15; do xz -dc $b/bins.tar.xz | tar -x -C /tmp/bins; done
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/common/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$LIBS:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
t0=$(date +%s)
