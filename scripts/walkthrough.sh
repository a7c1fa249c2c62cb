#!/usr/bin/env bash
# The README's "Drive the demo with curl", run exactly as written against a
# live shop, every answer checked.
#
#   bash scripts/walkthrough.sh
#
# The commands are not copied here: they are read from the ```sh blocks of
# that README section and run one by one, in order, in this shell, the way a
# newcomer pastes them into a terminal (no errexit, no nounset, no pipefail).
# Only `localhost:8080` is rewritten, to the address of a shop this script
# starts on a free port with a fresh SQLite database and every other setting
# at its default, as `cargo run --release -p shop` in the README has it. Both
# blocks run in this one shell, so `$PAY_ID` from the first reaches the
# second, as in the newcomer's terminal.
#
# Each README command has one entry in the table further down, in the same
# order: a piece of its text, checked first so that a README edit which adds,
# drops or reorders commands fails here until the table follows, and the
# checks its answer must pass. Any mismatch names the README line and the
# command, prints the answer, and exits non-zero.
#
# Timing: the only race in the walkthrough is the in-flight step, and its
# margin is the policy's, not the machine's speed: the backgrounded request
# has 1 s (the README's `sleep 1`) to claim its key, the retry then has the
# remaining 4 s of the simulated 5 s bank delay to get its 409, and the
# README's `wait` makes the account read come after that request finished.
#
# The shop binary: $SHOP_BIN, else $CARGO_TARGET_DIR/debug/shop (target/
# without it), built with `cargo build -p shop --all-features` if missing.
# The shop, any request the README left in the background, and the temporary
# directory are removed on every exit.
set -euo pipefail
cd "$(dirname "$0")/.."

wt_section='## Drive the demo with curl'
# The file that holds it (shop's README: the front page links there).
wt_readme=apps/shop/README.md
# Where cargo (and scripts/test's `cargo test`) puts it.
wt_shop_bin="${SHOP_BIN:-${CARGO_TARGET_DIR:-target}/debug/shop}"

wt_tmp="$(mktemp -d)"
wt_pid=""

wt_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # Stop the shop first: a request still running in the background (the
  # README's `&`, if a check failed before its `wait`) ends with it.
  if [ -n "$wt_pid" ] && kill -0 "$wt_pid" 2>/dev/null; then
    kill -TERM "$wt_pid" 2>/dev/null || true
    for _ in $(seq 1 150); do
      kill -0 "$wt_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$wt_pid" 2>/dev/null || true
  fi
  local wt_job
  for wt_job in $(jobs -p); do kill "$wt_job" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$wt_tmp"
  exit "$rc"
}
trap wt_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- Reading the README ----------------------------------------------------

# Every command of the section's ```sh blocks: its text (continuation lines
# joined), its README line and its block. Blank and comment-only lines are
# not commands.
wt_cmds=()
wt_cmd_lines=()
wt_cmd_blocks=()
wt_blocks=0
wt_read_readme() {
  local n=0 in_section=0 in_block=0 cmd="" start=0 line
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    if [ "$in_section" = 0 ]; then
      [ "$line" = "$wt_section" ] && in_section=1
      continue
    fi
    if [ "$in_block" = 0 ]; then
      case $line in
        '```sh') in_block=1; wt_blocks=$((wt_blocks + 1)) ;;
        '#'*) break ;; # the next heading: the section is over
      esac
      continue
    fi
    if [ "$line" = '```' ]; then
      in_block=0
      continue
    fi
    [ -z "$cmd" ] && start=$n
    cmd+=$line
    if [[ $line == *\\ ]]; then
      cmd+=$'\n'
      continue
    fi
    if [[ ! $cmd =~ ^[[:space:]]*(#.*)?$ ]]; then
      wt_cmds+=("$cmd")
      wt_cmd_lines+=("$start")
      wt_cmd_blocks+=("$wt_blocks")
    fi
    cmd=""
  done <"$wt_readme"
  if [ "$in_section" = 0 ]; then
    echo "walkthrough: $wt_readme has no section '$wt_section'" >&2
    exit 1
  fi
}

# --- The checks --------------------------------------------------------------
# Each runs against $wt_out, the answer (stdout) of the current command.

wt_fail() {
  {
    echo
    echo "walkthrough: FAILED at $wt_readme line $wt_line (block $wt_block, command $wt_step):"
    printf '    %s\n' "$wt_cmd"
    echo "  $*"
    if [ -n "${wt_out:-}" ]; then
      echo "  the answer ($wt_out_name):"
      if [ -s "$wt_out" ]; then head -c 4000 "$wt_out" | tr -d '\r' | sed 's/^/  | /'; echo; else echo "  | (nothing)"; fi
      if [ -s "$wt_out.err" ]; then echo "  its stderr:"; tr -d '\r' <"$wt_out.err" | sed 's/^/  | /'; fi
    fi
    if [ -s "$wt_tmp/shop.log" ]; then
      echo "  the shop's log, last lines:"
      tail -n 15 "$wt_tmp/shop.log" | sed 's/^/  | /'
    fi
  } >&2
  exit 1
}

# The answer's header lines (without the status line), CRs removed.
wt_headers() {
  head -n 1 "$wt_out" | grep -q '^HTTP/' || return 0
  sed -n '2,/^\r*$/p' "$wt_out" | tr -d '\r' | sed '/^$/d'
}

# The answer's body, byte for byte (everything after the headers of `curl -i`).
wt_body() {
  if head -n 1 "$wt_out" | grep -q '^HTTP/'; then
    sed '1,/^\r*$/d' "$wt_out"
  else
    cat "$wt_out"
  fi
}

# status CODE: the status line says CODE.
status() {
  local line
  line="$(head -n 1 "$wt_out" | tr -d '\r')"
  [[ $line =~ ^HTTP/[0-9.]+\ $1(\ |$) ]] || wt_fail "expected status $1, got: ${line:-(no answer)}"
}

# header NAME ERE: NAME is sent once and its value matches ERE.
header() {
  local values count
  values="$(wt_headers | grep -i "^$1:" | sed 's/^[^:]*:[[:space:]]*//' || true)"
  count="$(printf '%s' "$values" | grep -c '' || true)"
  [ "$count" = 1 ] || wt_fail "expected one $1 header, got $count"
  [[ $values =~ $2 ]] || wt_fail "expected $1 matching /$2/, got: $values"
}

# no_header NAME: NAME is not sent.
no_header() {
  if wt_headers | grep -qi "^$1:"; then
    wt_fail "expected no $1 header, got: $(wt_headers | grep -i "^$1:")"
  fi
}

# problem TYPE: an application/problem+json whose type URI ends in TYPE
# (after a / or #: the base of the URI is not the README's business).
problem() {
  header Content-Type '^application/problem\+json'
  wt_body | grep -qE "\"type\":\"[^\"]*[/#]$1\"" ||
    wt_fail "expected a problem of type …/$1"
}

# json NAME VALUE: the body has "NAME":VALUE (VALUE as JSON: 3, "captured").
json() {
  wt_body | grep -qF "\"$1\":$2" || wt_fail "expected \"$1\":$2 in the body"
}

# quiet: the command printed nothing.
quiet() {
  [ ! -s "$wt_out" ] || wt_fail "expected no output"
}

# keep LABEL: this answer is LABEL, for later checks.
declare -A wt_kept
keep() { wt_kept[$1]="$wt_out"; }

# answer_of LABEL: the checks that follow look at LABEL's answer.
answer_of() {
  wt_out="${wt_kept[$1]}"
  wt_out_name="the answer kept as $1"
}

# same_body_as LABEL: byte for byte the body of LABEL's answer.
same_body_as() {
  cmp -s <(wt_body) <(wt_out="${wt_kept[$1]}" wt_body) ||
    wt_fail "expected the same body as $1's answer:$(printf '\n%s' "$(wt_out="${wt_kept[$1]}" wt_body)")"
}

# same_header_as LABEL NAME: NAME has the value it has in LABEL's answer.
same_header_as() {
  local theirs
  theirs="$(wt_out="${wt_kept[$1]}" wt_headers | grep -i "^$2:" | sed 's/^[^:]*:[[:space:]]*//' || true)"
  [ -n "$theirs" ] || wt_fail "$1's answer has no $2 header"
  header "$2" "^$(printf '%s' "$theirs" | sed 's/[]\/$*.^[|+?(){}]/\\&/g')\$"
}

# pay_id_of LABEL: $PAY_ID was set from LABEL's Location and printed.
pay_id_of() {
  [[ ${PAY_ID:-} =~ ^pay_[A-Za-z0-9]+$ ]] || wt_fail "expected PAY_ID=pay_…, got: '${PAY_ID:-}'"
  local location
  location="$(wt_out="${wt_kept[$1]}" wt_headers | grep -i '^location:' | sed 's/^[^:]*:[[:space:]]*//')"
  [ "$location" = "/payments/$PAY_ID" ] || wt_fail "PAY_ID=$PAY_ID is not $1's Location ($location)"
  [ "$(cat "$wt_out")" = "$PAY_ID" ] || wt_fail "expected it to print $PAY_ID"
}

# events_once ID: the event list has ID, and no event twice.
events_once() {
  local ids
  ids="$(wt_body | grep -o '"event_id":"[^"]*"' || true)"
  [ "$(printf '%s\n' "$ids" | grep -cxF "\"event_id\":\"$1\"")" = 1 ] || wt_fail "expected $1 once in the events"
  [ -z "$(printf '%s\n' "$ids" | sort | uniq -d)" ] || wt_fail "an event is listed twice"
}

# --- The table: one entry per README command, in order -----------------------
# expect BLOCK 'piece of the command' 'checks of its answer'
wt_expect_blocks=()
wt_expect_pieces=()
wt_expect_checks=()
expect() {
  wt_expect_blocks+=("$1")
  wt_expect_pieces+=("$2")
  wt_expect_checks+=("$3")
}

expect 1 "B='"                     'quiet'
expect 1 'pay() {'                 'quiet'
expect 1 'R=$(pay'                 'status 201; header Location "^/payments/pay_[A-Za-z0-9]+$"; no_header Idempotent-Replayed; keep k1'
expect 1 'PAY_ID=$('               'pay_id_of k1'
expect 1 'Key: k1'                 'status 201; header Idempotent-Replayed "^true$"; same_header_as k1 Location; same_body_as k1'
expect 1 'Key: "k1"'               'status 201; header Idempotent-Replayed "^true$"; same_header_as k1 Location; same_body_as k1'
expect 1 '"amount":5'              'status 422; problem idempotency-key-reused'
expect 1 'pay -d "$B"'             'status 400; problem idempotency-key-missing'
expect 1 'Key;'                    'status 400; problem idempotency-key-invalid'
expect 1 'Key: k9'                 'status 401; problem unauthorized'
expect 1 'Key: k2'                 'status 400; problem validation'
expect 1 'bank-delay=5000'         'keep k3' # answers in the background: checked at `wait`
expect 1 'sleep 1;'                'status 409; problem idempotency-key-in-use; header Retry-After "^[1-9][0-9]*$"'
expect 1 'wait'                    'quiet; answer_of k3; status 201; header Location "^/payments/pay_"; no_header Idempotent-Replayed'
expect 1 'bank-error'              'status 502; problem bank-unavailable'
expect 1 'Key: k4'                 'status 201; header Location "^/payments/pay_"; no_header Idempotent-Replayed'
expect 1 'Key: k5'                 'status 413; problem payload-too-large'
expect 1 'client-1'                'json payments 3; json charged_total 3000; json bank_charges 3'
expect 1 'client-2'                'json payments 0; json charged_total 0; json bank_charges 0'
expect 2 'AUTH='                   'quiet'
expect 2 'O='                      'quiet'
expect 2 '/orders'                 'status 201; header Location "^/orders/ord_[A-Za-z0-9]+$"; keep order'
expect 2 '/orders'                 'status 200; same_header_as order Location; same_body_as order'
expect 2 '$PAY_ID/capture'         'status 200; json id "\"$PAY_ID\""; json status "\"captured\""; keep capture'
expect 2 '$PAY_ID/capture'         'status 200; same_body_as capture'
expect 2 'client-2'                'status 404; problem not-found'
expect 2 '"price":300'             'status 201; header ETag "^\"1\"$"'
expect 2 '"price":310'             'status 200; header ETag "^\"2\"$"'
expect 2 '"price":320'             'status 412; problem precondition-failed'
expect 2 'E='                      'quiet'
expect 2 '/webhooks/bank'          'status 200; json status "\"processed\""'
expect 2 '/webhooks/bank'          'status 200; json status "\"duplicate\""'
expect 2 'charge.note'             'status 422; problem event-id-reused'
expect 2 '$PAY_ID/events'          'json payment_id "\"$PAY_ID\""; events_once evt-1'

# --- Run ---------------------------------------------------------------------

wt_read_readme
if [ "$wt_blocks" != 2 ]; then
  echo "walkthrough: expected two \`\`\`sh blocks in $wt_readme's '$wt_section', found $wt_blocks" >&2
  exit 1
fi

if [ ! -x "$wt_shop_bin" ]; then
  [ -z "${SHOP_BIN:-}" ] || { echo "walkthrough: SHOP_BIN=$SHOP_BIN is not an executable" >&2; exit 1; }
  echo "walkthrough: building shop ($wt_shop_bin is missing)"
  cargo build --quiet -p shop --all-features
fi

# The README's premise: shop with its defaults. Settings from the
# environment would change the answers (IDEM_WAIT_MS turns the 409 into a
# wait, SHOP_WEBHOOK_SECRET refuses unsigned events, ...).
env -u SHOP_LISTEN -u DATABASE_URL -u IDEM_LEASE_MS -u IDEM_TTL_SECS -u REDIS_URL \
  -u IDEM_REDIS_CLUSTER -u IDEM_STORE -u IDEM_REDIS_PREFIX -u BROKER_URL -u SHOP_BROKER_PREFIX \
  -u IDEM_REPLAY_CACHE -u IDEM_CLAIM_IN_TX -u IDEM_RETRY_AFTER_SECS -u SHOP_WEBHOOK_SECRET \
  -u SHOP_HEADER_TIMEOUT_SECS -u SHOP_BODY_TIMEOUT_SECS -u SHOP_MAX_CONNECTIONS \
  -u SHOP_SHUTDOWN_GRACE_SECS -u SHOP_FAULT_INJECTION -u IDEM_WAIT_MS \
  "$wt_shop_bin" --listen 127.0.0.1:0 --database-url "sqlite:$wt_tmp/shop.db" \
  >"$wt_tmp/shop.out" 2>"$wt_tmp/shop.log" &
wt_pid=$!
# Not a job of this shell: the README's own `wait` waits for its request,
# not for the shop.
disown "$wt_pid"

wt_base=""
for _ in $(seq 1 600); do
  kill -0 "$wt_pid" 2>/dev/null || { tail -n 30 "$wt_tmp/shop.log" >&2; echo "walkthrough: shop exited at start" >&2; exit 1; }
  [ -n "$wt_base" ] || wt_base="$(sed -n 's|^shop listening on http://||p' "$wt_tmp/shop.out" | head -n 1)"
  if [ -n "$wt_base" ] &&
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://$wt_base/healthz" || true)" = 200 ]; then
    break
  fi
  sleep 0.1
done
[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://${wt_base:-none}/healthz" || true)" = 200 ] ||
  { tail -n 30 "$wt_tmp/shop.log" >&2; echo "walkthrough: shop did not answer within 60 s" >&2; exit 1; }
echo "walkthrough: shop on http://$wt_base (fresh SQLite database), $wt_readme's '$wt_section'"

# curl as the README runs it, but with no user ~/.curlrc, no proxy for the
# shop, and a bound on each request so that a hung shop fails the step
# instead of the run.
mkdir "$wt_tmp/curl"
echo 'max-time = 60' >"$wt_tmp/curl/.curlrc"
export CURL_HOME="$wt_tmp/curl" XDG_CONFIG_HOME="$wt_tmp/curl"
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"

wt_step=0
# The README's commands run in this shell: every name of the script's own
# starts with wt_ (but the checks' verbs, above) so that they cannot collide.
for wt_i in "${!wt_cmds[@]}"; do
  wt_step=$((wt_i + 1))
  wt_cmd="${wt_cmds[wt_i]}"
  wt_line="${wt_cmd_lines[wt_i]}"
  wt_block="${wt_cmd_blocks[wt_i]}"
  wt_out=""
  if [ "$wt_i" -ge "${#wt_expect_pieces[@]}" ]; then
    wt_fail "the README has more commands than this script checks: add an entry to its table"
  fi
  if [ "$wt_block" != "${wt_expect_blocks[wt_i]}" ] || [[ $wt_cmd != *"${wt_expect_pieces[wt_i]}"* ]]; then
    wt_fail "the script's table expects here a command of block ${wt_expect_blocks[wt_i]} with '${wt_expect_pieces[wt_i]}': README and table differ"
  fi
  wt_run="${wt_cmd//localhost:8080/$wt_base}"
  if [[ $wt_run == *localhost* || $wt_run == *8080* ]]; then
    wt_fail "a command must reach the shop as localhost:8080, nothing else"
  fi
  wt_out="$wt_tmp/answer.$wt_step"
  wt_out_name="stdout"
  # As typed into a terminal: no errexit, no nounset, no pipefail.
  set +euo pipefail
  eval "$wt_run" >"$wt_out" 2>"$wt_out.err"
  set -euo pipefail
  eval "${wt_expect_checks[wt_i]}"
  printf 'ok  %s:%-4s %s\n' "$wt_readme" "$wt_line" "$(printf '%s' "$wt_cmd" | head -n 1)"
done
if [ "${#wt_cmds[@]}" -lt "${#wt_expect_pieces[@]}" ]; then
  wt_step=$((${#wt_cmds[@]} + 1)) wt_line="(end)" wt_block="$wt_blocks" wt_cmd="" wt_out=""
  wt_fail "the README has fewer commands (${#wt_cmds[@]}) than this script checks (${#wt_expect_pieces[@]})"
fi
echo "walkthrough: all ${#wt_cmds[@]} commands answered as the README says"
