"""Trusted state harness that runs *inside* the sandbox (stdlib only; run as `python -I -S -c <file>`).

A state check (e.g. `repo_fix`'s final check, `workspace.check_repo`) asks: once the agent is
done, does its module hold the right values? The host never runs the agent's tests to find out
(an exit status, a printed line or an `assert x == 37` are all decided by the agent's code: a
module can `raise SystemExit`, `os._exit(0)`, patch `print`, or define a constant whose `__eq__`
always says True). Instead this harness imports the module, reads the named values, converts them
with `plain` (exact builtin types only), and writes one line `<nonce> <json>` to the sandbox's
stdout; the HOST parses that line and compares the values with the expected ones, which it holds
and never sends into the sandbox.

Protocol: stdin carries `{"nonce", "module", "source", "names"}`; the harness reads it before any of the
agent's code runs, takes a raw duplicate of stdout, points fd 1 at stderr (so whatever the module
prints lands on stderr, never on the result channel), puts the working directory on `sys.path`
for the one import only, and ends with `os._exit(0)` right after its one `os.write` (no atexit
hook, no flush of the module's buffers). Result: `{"values": {name: value}}`, or `{"error": ...}`
when the import or a read raised anything (SystemExit included) or a value is not plain data.
Run with `-I -S`: no site, no user site, no PYTHON* variables and no working directory on
`sys.path` while the harness imports its own modules, so a `json.py`, `os.py`, `sitecustomize.py`,
`usercustomize.py` or `.pth` file in the workspace changes nothing (the module itself may import
only the standard library).

What is checked is the module's source, never anything that stands in for it. The host names the
source file (`RepoTask.source`: `a/b.py`, or `a/b/__init__.py` for a package) and the harness
executes that file (`load_source`), so a package `a/b/` beside `a/b.py`, a sourceless `b.pyc`
or an extension module `b.*.so` -- each of which a plain `import a.b` would take first -- is not
what is read: the decision is that shadowing neither passes nor fails a check, the source does.
Run with `-B -X pycache_prefix=/dev/null`, no bytecode is written and none is read from the
workspace's `__pycache__` (a stale or unchecked-hash `.pyc` beside a buggy source changes nothing);
what the source imports from the workspace is imported from `.py` sources only (`source_finder`).

Threat model, honestly: the module runs in this process, so it can do anything this harness can:
read the nonce (frame inspection, `gc`), patch `json`, `os.write` or `plain`, write a line of its
own, or exit before the harness writes. None of that passes a check. Every way it keeps the
harness from writing (exiting, crashing, hanging, flooding) leaves no result line; a line without
the nonce is ignored; a second nonce line beside the harness's makes two, and the host refuses
anything but exactly one; whatever values a forged line carries are compared by the host as
plain JSON data. So the only way to pass is to get the expected values out, and the module only
knows them the way a fix does (from the test the agent reads): a forgery is a fix by other means,
never an easier one. The nonce (per check, random, from the host over stdin: not in argv, the
environment or a file) keeps everything else the sandbox prints from being read as the result.
"""

import importlib
import importlib.util
import json
import math
import os
import sys
from importlib.machinery import SOURCE_SUFFIXES, FileFinder, SourceFileLoader

MAX_DEPTH = 16


def plain(value, depth=0):
    """`value` if it is plain JSON data built only of exact builtin types -- None, bool, int,
    finite float, str, list, dict with str keys -- else TypeError. Exact types (`type(v) is int`),
    so an `int` subclass with a rigged `__eq__`, `__index__` or `__repr__` is refused rather than
    converted; lists and dicts are copied, so nothing of the module's objects leaves."""
    t = type(value)
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        if not math.isfinite(value):
            raise TypeError(f"{value!r} is not a finite number")
        return value
    if depth >= MAX_DEPTH:
        raise TypeError(f"nested deeper than {MAX_DEPTH}")
    if t is list:
        return [plain(v, depth + 1) for v in value]
    if t is dict:
        if any(type(k) is not str for k in value):
            raise TypeError("a dict key is not a str")
        return {k: plain(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"a {t.__name__} is not plain data (None, bool, int, float, str, list, dict)")


def _describe(e):
    """`Type: message` of an exception, even when its `__str__` is the module's and misbehaves."""
    try:
        return f"{type(e).__name__}: {e}"[:300]
    except BaseException:
        return "an exception that cannot be shown"


def source_finder(cwd):
    """A path hook that imports only `.py` sources below `cwd` (no bytecode, no extension module)."""

    def hook(path):
        if path != cwd and not path.startswith(cwd + os.sep):
            raise ImportError("not the working directory")
        return FileFinder(path, (SourceFileLoader, SOURCE_SUFFIXES))

    return hook


def load_source(name, source, cwd):
    """Execute module `name` from its source file `source` (relative to `cwd`), whatever else
    a plain `import` would find first by that name (its parent packages import from source)."""
    parent = name.rpartition(".")[0]
    if parent:
        importlib.import_module(parent)
    path = os.path.join(cwd, source)
    package = [os.path.dirname(path)] if os.path.basename(source) == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    """Read the request, import the module from its source with its directory on sys.path, write
    one result line."""
    request = json.loads(sys.stdin.buffer.read())
    nonce, out, cwd = request["nonce"], os.dup(1), os.getcwd()
    os.dup2(2, 1)
    try:
        sys.path.insert(0, cwd)
        sys.path_hooks.insert(0, source_finder(cwd))
        sys.path_importer_cache.pop(cwd, None)
        try:
            module = load_source(request["module"], request["source"], cwd)
        finally:
            sys.path[:] = [p for p in sys.path if p != cwd]
        line = json.dumps({"values": {name: plain(getattr(module, name)) for name in request["names"]}})
    except BaseException as e:
        line = json.dumps({"error": _describe(e)})
    os.write(out, f"\n{nonce} {line}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main()
