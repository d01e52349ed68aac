#!/usr/bin/env bash
# CI, after the main test command: the framework adapters in the environments the main one
# (.venv, the test extra at the newest releases) cannot be.
#
#   oldest          every framework that fits beside the others at its oldest supported release
#                   (.ci/oldest.txt): the test modules of those frameworks, the adapters' imports,
#                   and the ASGI middleware beside Pydantic AI (the rest of tests/integrations
#                   uses none of these frameworks: the main environment runs it)
#   oldest-crewai   CrewAI at its oldest supported release (it pins mcp < 2): its tests
#   oldest-openai-agents
#                   openai-agents at its oldest supported release (before 0.20 it pins mcp < 2,
#                   before 0.21 openai < 3), with the openai of its own floor: its tests
#   google-adk, strands, crewai
#                   the newest releases of the frameworks that cannot be installed beside the
#                   other extras, each alone: its tests, and mypy on its adapter
#
# Each is a venv under .ci/venvs/ (git-ignored; TWICESHY_CI_VENVS moves it), built with
# `uv pip install -e '.[EXTRAS]'` and the test tools, and kept while its inputs (pyproject.toml,
# .ci/oldest.txt, this script, the Python, the checkout's path) are unchanged: a second run
# only runs the tests. uv (in a venv of its own there, installed by pip) resolves and installs
# in parallel, many times faster than pip; it is given pip's settings (`pip config list`: the
# indexes, find-links and constraint files this machine's pip reads and uv does not) and pip's
# choice among indexes (the best version from any of them), so the same releases result. Run
# it from anywhere; it is idempotent. In each, a test module whose framework is missing fails
# instead of skipping (TWICESHY_REQUIRE_FRAMEWORKS, read by tests/integrations/conftest.py), and
# so does a test that needs a server that is not there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENVS=${TWICESHY_CI_VENVS:-.ci/venvs}
PYTHON=${PYTHON:-python3}
OLDEST=.ci/oldest.txt
# The test tools, within the test extra's bounds.
TOOLS=("pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "mypy>=1.15")
# The frameworks of the oldest environment (all but CrewAI), as extras.
OLDEST_EXTRAS=openai-agents,langchain,pydantic-ai,mcp,fastmcp,google-adk,llama-index,strands,claude-agent-sdk
# The oldest openai-agents that installs beside mcp 2 and openai 3: the oldest environment's.
AGENTS_BESIDE_MCP2=0.21.0
# The openai of the oldest openai-agents' own floor (newer 2.x releases break 0.17.5 itself).
AGENTS_OLDEST_OPENAI=2.36.0
PIP=(--quiet --disable-pip-version-check --progress-bar off)
UV="$VENVS/uv/bin/uv"
UV_REQUIREMENT="uv>=0.13,<0.14"

export TWICESHY_REQUIRE_SERVERS=1
mkdir -p "$VENVS"
failed=()

inputs() {  # inputs NAME: the hash of what a venv is built from
    {
        echo "$1 $(pwd)"
        "$PYTHON" --version
        cat pyproject.toml "$OLDEST" .ci/frameworks.sh
    } | sha256sum | cut -d' ' -f1
}

current() {  # current NAME: whether the venv NAME was built from the inputs there are now
    [ -f "$VENVS/$1/.inputs" ] && [ "$(cat "$VENVS/$1/.inputs")" = "$(inputs "$1")" ]
}

uv_tool() {  # the uv that builds the other venvs, in a venv of its own, installed by pip
    local dir="$VENVS/uv"
    current uv && return 0
    echo "frameworks: installing $UV_REQUIREMENT"
    rm -rf "$dir" || return 1
    "$PYTHON" -m venv "$dir" || return 1
    "$dir/bin/python" -m pip install "${PIP[@]}" "$UV_REQUIREMENT" || return 1
    inputs uv >"$dir/.inputs"
}

pip_settings() {  # the settings this machine's pip reads from its config and PIP_*, as uv options
    # One option a line. A setting that changes what is installed and has no uv option here
    # stops the build rather than be dropped.
    "$PYTHON" -m pip config list | "$PYTHON" -c '
import ast
import sys

RANK = {"global": 0, "install": 1, ":env:": 2}  # pip: [install] over [global], PIP_* over both
MANY = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
        "constraint": "--constraint"}
IGNORED = {"cert", "default-timeout", "timeout", "disable-pip-version-check", "progress-bar",
           "quiet", "verbose", "no-color", "no-input", "root-user-action", "no-cache-dir",
           "cache-dir"}
settings = {}
for line in sys.stdin:
    name, _, value = line.strip().partition("=")
    section, _, key = name.rpartition(".")
    if section in RANK and RANK[section] >= settings.get(key, (-1, ""))[0]:
        settings[key] = (RANK[section], ast.literal_eval(value))
for key, (_, value) in sorted(settings.items()):
    if key == "index-url":
        print("--index-url", value, sep="\n")
    elif key in MANY:
        for item in value.split():
            print(MANY[key], item, sep="\n")
    elif key == "no-index" and value.lower() in ("1", "true", "yes", "on"):
        print("--no-index")
    elif key not in IGNORED:
        sys.exit(f"frameworks: pip reads {key}={value!r} and uv would not: not translated")
'
}

build() {  # build NAME EXTRAS [CONSTRAINTS]: make the venv NAME unless it is current
    local name=$1 extras=$2 constraints=${3:-} dir="$VENVS/$1"
    if current "$name"; then
        echo "frameworks: $name: venv is current"
        return 0
    fi
    echo "frameworks: $name: building the venv"
    # (Each command checked: `set -e` does not reach into a function called by `if`.)
    rm -rf "$dir" || return 1
    "$PYTHON" -m venv --without-pip "$dir" || return 1
    local found settings=() args=(-e ".[$extras]" "${TOOLS[@]}")
    if [ -n "$constraints" ]; then
        args+=(--constraint "$constraints")
    fi
    found=$(pip_settings) || return 1
    if [ -n "$found" ]; then
        mapfile -t settings <<<"$found"
    fi
    # unsafe-best-match: pip's way, the newest fitting release on any index (uv's own way
    # takes a package only from the first index that has it). --compile-bytecode: as pip does.
    "$UV" pip install --quiet --python "$dir/bin/python" --index-strategy unsafe-best-match \
        --compile-bytecode "${settings[@]}" "${args[@]}" || return 1
    inputs "$name" >"$dir/.inputs"
}

run() {  # run NAME REQUIRED PYTEST-ARGS...: the tests in the venv NAME, its frameworks required
    local name=$1 required=$2
    shift 2
    echo "frameworks: $name: pytest $*"
    if ! TWICESHY_REQUIRE_FRAMEWORKS=$required "$VENVS/$name/bin/python" -m pytest -q \
        -p no:cacheprovider "$@"; then
        failed+=("$name: tests")
    fi
}

check_types() {  # check_types NAME MODULE: mypy on one adapter, in the venv that has its framework
    local name=$1 module=$2
    echo "frameworks: $name: mypy $module"
    # The modules it imports are checked by the main environment's mypy (their drivers are
    # not installed here): only this one is reported.
    if ! "$VENVS/$name/bin/mypy" --follow-imports=silent "$module"; then
        failed+=("$name: mypy $module")
    fi
}

step() {  # step NAME COMMAND...: one environment, timed; a failed build is reported, not fatal
    local name=$1 start=$SECONDS
    shift
    if ! "$@"; then
        failed+=("$name: build")
    fi
    echo "frameworks: $name: $((SECONDS - start)) s"
}

oldest() {
    local pins="$VENVS/oldest.txt"
    grep -v -e '^crewai==' -e '^openai-agents==' "$OLDEST" >"$pins"
    echo "openai-agents==$AGENTS_BESIDE_MCP2" >>"$pins"
    build oldest "$OLDEST_EXTRAS" "$pins" || return 1
    # The pins are the floors of the extras' bounds: a floor raised without its pin (or the
    # other way round) is caught here.
    "$VENVS/oldest/bin/python" - "$OLDEST" <<'EOF' || { failed+=("oldest: floors"); return 0; }
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

pins = {}
for line in open(sys.argv[1], encoding="utf-8"):
    if line.strip() and not line.startswith("#"):
        name, _, version = line.strip().partition("==")
        pins[name] = Version(version)
wrong = []
for text in metadata.requires("twiceshy") or []:
    requirement = Requirement(text)
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    if requirement.name in pins and floors and floors[0] != pins[requirement.name]:
        wrong.append(f"{requirement} (pinned: {pins[requirement.name]})")
for line in sorted(set(wrong)):
    print(f"frameworks: the floor of {line} is not its pin in .ci/oldest.txt", file=sys.stderr)
sys.exit(1 if wrong else 0)
EOF
    # The modules of the frameworks pinned here (by the start of their names, as the NEEDS of
    # tests/integrations/conftest.py), every adapter's import, and test_asgi.py (its agents are
    # Pydantic AI's); not the modules that need none of these frameworks (HTTP clients,
    # OpenTelemetry, the adapters' shared pieces), the same here as in the main environment.
    local modules=(tests/integrations/test_adapter_imports.py tests/integrations/test_asgi.py)
    local extra
    for extra in ${OLDEST_EXTRAS//,/ }; do
        modules+=(tests/integrations/test_"${extra//-/_}"*.py)
    done
    run oldest "$OLDEST_EXTRAS" "${modules[@]}"
}

oldest_alone() {  # oldest_alone EXTRA MODULE [PIN...]: one framework at its floor, alone
    local extra=$1 module=$2 name="oldest-$1" pins="$VENVS/oldest-$1.txt"
    shift 2
    # Its own pin from .ci/oldest.txt, and the PINs its floor needs beside it.
    { grep "^$extra==" "$OLDEST"; [ $# -eq 0 ] || printf '%s\n' "$@"; } >"$pins"
    build "$name" "$extra" "$pins" || return 1
    run "$name" "$extra" tests/integrations/test_"$module"*.py
}

alone() {  # alone EXTRA MODULE: the newest release of one framework, in a venv of its own
    local extra=$1 module=$2
    build "$extra" "$extra" || return 1
    run "$extra" "$extra" tests/integrations/test_"$module"*.py
    check_types "$extra" "src/twiceshy/integrations/$module.py"
}

total=$SECONDS
uv_tool || { echo "frameworks: could not install uv" >&2; exit 1; }
step oldest oldest
step oldest-crewai oldest_alone crewai crewai
step oldest-openai-agents oldest_alone openai-agents openai_agents "openai==$AGENTS_OLDEST_OPENAI"
step google-adk alone google-adk google_adk
step strands alone strands strands
step crewai alone crewai crewai
echo "frameworks: $((SECONDS - total)) s in all"

if [ ${#failed[@]} -gt 0 ]; then
    printf 'frameworks: failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "frameworks: all green"
