# Sourced (`. bench/kit/device_call.sh`) by the device-call scripts in bench/, run from the project root on the device
# machine with `.whl` carried (bash bench/device_wheels.sh): installs those wheels into /tmp/site (or stops the
# calling script), puts them and src/ on the path (py-spy's binary too), and sets OUT to the folder that comes back.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp}

# One serving_table.py run, 3 repeats, ending before second `end` of the call: name, end, its arguments... Back under
# $OUT: <name>.log (console) and <name>.md (table); reports and server logs stay in /tmp/<name>/ on the device.
serving_table_run() {
  local name=$1 end=$2; shift 2
  local left=$((end - SECONDS))
  [ $left -gt 60 ] || { echo "== $name skipped: ${left} s left"; return; }
  timeout $((590 - SECONDS)) python3 bench/serving_table.py "$@" --repeats 3 --budget-s $left --out /tmp/$name \
    > $OUT/$name.log 2>&1
  cp /tmp/$name/table.md $OUT/$name.md 2>/dev/null
  echo "== $name (t=${SECONDS} s)"; grep "ready in\|skipped\|budget" $OUT/$name.log
  cat $OUT/$name.md 2>/dev/null || tail -20 $OUT/$name.log
}
