"""Run identity for what you pass in: what makes a run "the same run" as one already in a run dir.

    fp = model_fingerprint(model)        # Fingerprint("MLP", parts={"structure": ..., "code MLP.forward": ...})
    fp.tag                               # "MLP#1a2b3c4d": goes into the config field (model, dataset, ...)
    data_fingerprint(train, test)        # the data's content: tensors, arrays, files (size, mtime)
    optimizer_fingerprint(opt_or_factory, model), scheduler_fingerprint(sched_or_factory, opt)
    code_digest(loss_fn)                 # 8 hex digits of what a function runs

What is read (never values drawn through ``__getitem__`` or ``forward``, which may be random):

- **code**: the bytecode and constants of each function of your own (not the standard library's or
  an installed package's), and what it reaches: the module-level names it uses (values, functions,
  classes), the names it reaches through a module of your own (``mycfg.SCALE``), the values it
  closes over, its default arguments, a ``functools.partial``'s arguments, a callable object's class
  and attributes, every method and class attribute of your own classes (``act = staticmethod(torch.relu)``),
  what it names on a builtin or C-extension module that is plain data or yours (``math.X`` set at import);
  the environment variables it reads by a constant name (``os.environ["MUL"]``, ``os.getenv("MUL")``: the
  value, or that it is unset; a read by another name is listed in ``unproven``; a launcher's, such as
  ``RANK`` or ``WORLD_SIZE``, is not the run's identity). A script's top level that made a ``Loop``: its
  code, and its settings at that line (:func:`_settings`);
- **model**: parameter and buffer names, shapes and dtypes, ``repr`` (layer types and settings),
  the code and attributes (private ones too) of each of your own module classes, and each library
  module's constructor settings: its public attributes of plain values (``num_heads``, ``norm_first``),
  which ``repr`` may not show. A module your code reaches (a loss's ``nn.CrossEntropyLoss``) is read
  the same way, with its buffers (``weight=``) by content;
- **data**: each split's length, class code and attributes; tensors and arrays by content (SHA-256),
  files a dataset names (an ImageFolder's images included) by relative path, size and modification
  time, as ``make`` and ``rsync``'s quick check do; the ``collate_fn``'s code and the ``meta`` given.
  A folder named by a dataset is not listed (it may hold logs, caches or the run dir itself, which
  change with every run): the list a dataset keeps is read instead, and a folder none of whose files
  is read is listed in ``unproven`` (its files are read by name only);
- **optimizer** and **scheduler**: class, each parameter group's settings and size, the scheduler's
  state at step 0 (a factory is called once for this, a scheduler factory with a nominal 1000 steps).

Initial weight values are left out on purpose (parameters and tensors that require grad are read by
shape and dtype only), and a device by its type only (a rank's ``cuda:3`` is not the run's identity):
an unseeded script must still resume its own run, and every rank must compute the same identity.
What cannot be read (an object with no readable state: an open file, a database handle) is listed
in ``Fingerprint.unproven``; see :func:`ddpkit.run.rundir.check_run_dir` for what that changes.
Each fingerprint's ``parts`` are kept in ``RUN_DIR/identity.json``, so a refusal can say in words
which part differs.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import dis
import enum
import functools
import hashlib
import importlib.machinery
import json
import linecache
import logging
import os
import re
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError, article, raised_at

# Where the standard library, installed packages and ddpkit itself live: code there is named, not read.
_LIBRARY_DIRS = tuple(
    sorted(
        {os.path.realpath(p) for k in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(k))}
        | {os.path.dirname(os.path.realpath(__file__)) + os.sep}
    )
)
_SCHEDULE_PROBE_STEPS = 1000  # the total_steps a scheduler factory is called with to read its settings
_MAX_DEPTH = 5  # object attributes followed this deep
_TEXT = 100  # part values longer than this (characters) are kept as a digest
# What ddpkit reads, by version (in identity.json): a run dir fingerprinted by an older reading
# (none written: 1) lacks the parts added since, so its tags cannot be compared with today's.
# 3: environment variables, and what code names on a builtin or C-extension module (math.X).
READING = 3
# Attributes every nn.Module has (its parameters, buffers, children, hooks keyed by global handle
# numbers, the training flag): read through their own paths, or not part of what a module computes.
_MODULE_BASE = frozenset(vars(nn.Module()))


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """What was read of one thing you passed in: ``parts`` (a readable label -> a readable value or
    a digest) and ``unproven`` (what could not be read). Two runs match when their parts match."""

    name: str
    parts: dict = field(default_factory=dict)
    unproven: tuple = ()
    # A Loop's code's environment reads, {label: value as parts would hold it}: recorded, not compared, so that a
    # resume can say the ones that changed (a setting read from the environment is otherwise silently the snapshot's)
    environ: dict = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return _digest(self.parts)[:8]

    @property
    def tag(self) -> str:
        return f"{self.name}#{self.digest}"

    def to_json(self) -> dict:
        made = {"name": self.name, "parts": self.parts, "unproven": list(self.unproven), "reading": READING}
        return {**made, "environ": self.environ} if self.environ else made


def _module_of(obj: Any) -> str:
    """The module ``obj`` was defined in, by the name a run identity gives it: the script's own (``__main__``)
    under either name it runs as. A worker of ``ddpkit.launch`` (multiprocessing's forkserver) imports the
    script as ``__mp_main__``, where a world of one runs it in the script's process as ``__main__``: the same
    code read as two, and a resume at another world size refused (the porter's seed-001 port)."""
    name = getattr(obj, "__module__", None) or ""
    return "__main__" if name == "__mp_main__" else name


def _in_library(filename: str) -> bool:
    if filename.startswith("<"):  # "<string>" (python -c), "<stdin>", notebooks' "<ipython-input-..>" are yours
        return filename.startswith("<frozen")
    return os.path.realpath(filename).startswith(_LIBRARY_DIRS)


def _module_in_library(name: str) -> bool:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path is None:  # __main__ of python -c or a notebook is yours; builtins are not
        return name in sys.builtin_module_names or name == "builtins"
    return _in_library(path)


def _module_object_in_library(module: types.ModuleType) -> bool:
    """Whether a module object (``import mycfg``) is the standard library's, a package's or ddpkit's."""
    path = getattr(module, "__file__", None)
    if path:
        return _in_library(path)
    spec = getattr(module, "__spec__", None)
    if module.__name__ in sys.builtin_module_names or getattr(spec, "origin", None) in ("built-in", "frozen"):
        return True
    folders = list(getattr(module, "__path__", None) or [])  # a namespace package: where its folders are
    return bool(folders) and all(_in_library(os.path.join(f, "")) for f in folders)


def _plain(v: Any, depth: int = 0) -> bool:
    """A library module's setting worth reading: a number, a string, a dtype, a function or class (by
    name), or a short list or dict of these. Not an object: a compiled module's context holds the
    machine's thread count and handles, which differ between nodes and runs."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)):
        return True
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, functools.partial, type)):
        return True
    if isinstance(v, (list, tuple)) and depth < 3 and len(v) <= 64:
        return all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict) and depth < 3 and len(v) <= 64:
        return all(isinstance(k, str) and _plain(x, depth + 1) for k, x in v.items())
    return False


def _module_settings(module: nn.Module):
    """(name, value) of what a module holds beyond its parameters, buffers, children and hooks. Your own
    module classes: every attribute, private ones too. A library module (``nn.MultiheadAttention``): its
    public attributes of plain values, the settings its constructor was given (``num_heads``), which
    ``repr`` may not show; its private ones are derived state or handles (a compiled module's id)."""
    mine = not _module_in_library(type(module).__module__)
    for k, x in vars(module).items():
        if k in _MODULE_BASE or k.startswith("__"):
            continue
        if mine or (not k.startswith("_") and _plain(x)):
            yield k, x


def _const(k: Any) -> Any:
    """A code constant as the same text in every process: ``x in {"a", "b"}`` compiles to a frozenset,
    whose repr order follows the string hash seed (PYTHONHASHSEED), so its items are sorted."""
    if isinstance(k, types.CodeType):
        return _code(k)
    if isinstance(k, frozenset):
        return ["frozenset", sorted(repr(x) for x in k)]
    if isinstance(k, tuple):
        return ["tuple", [_const(x) for x in k]]
    return repr(k)


def _code(c: types.CodeType) -> list:
    consts = [_const(k) for k in c.co_consts]
    return [c.co_code.hex(), consts, list(c.co_names), c.co_argcount, c.co_kwonlyargcount]


def _global_names(c: types.CodeType) -> list[str]:
    """The global names a code object and its nested functions load (``LOAD_GLOBAL``; ``LOAD_NAME`` in a class
    body), not the attribute names its ``co_names`` also holds: ``self.save_every`` read the script's global
    ``save_every`` (set in its ``if __name__ == "__main__":`` block, so only where the script ran as
    ``__main__``), and a run at 2 processes (spawned: ``__mp_main__``) could not resume at 1 (the porter's seed
    003)."""
    out = [op.argval for op in dis.get_instructions(c) if op.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            out += _global_names(k)
    return list(dict.fromkeys(out))


def _names(c: types.CodeType) -> list[str]:
    """The global and attribute names a code object and its nested functions use."""
    out = list(c.co_names)
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            out += _names(k)
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------- values set outside your code
_ABSENT = object()
# Set for each rank or attempt by a launcher (torchrun, SLURM, MPI) or by ddpkit, or naming the rank's devices
# and network: where and how a rank runs, not what it computes. Read, they would make ranks disagree and an
# elastic resume at another world size another run, so they are neither read nor listed.
_PLACEMENT_ENV = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_WORLD_SIZE|ROLE_NAME"
    r"|MASTER_ADDR|MASTER_PORT|CUDA_VISIBLE_DEVICES|HIP_VISIBLE_DEVICES|OMP_NUM_THREADS|CUBLAS_WORKSPACE_CONFIG"
    r"|(TORCHELASTIC|TORCH|SLURM|OMPI|PMI|PMIX|NCCL|GLOO|DDPKIT)_\w+)"
)
_SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)  # kept as a digest, never in clear
_ENV_READS = frozenset({"get", "setdefault", "pop", "__getitem__", "__contains__"})  # os.environ.get("K")
_ENV_WRITES = frozenset({"update", "clear", "__setitem__", "__delitem__"})  # what code sets is not an input
_LOADS = frozenset(
    {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_CLASSDEREF"}
)
_ATTRS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# Opcodes between an expression's parts that say nothing of it (call set-up, caches), across Python 3.9-3.13
_FILLER = frozenset({"CACHE", "NOP", "EXTENDED_ARG", "PUSH_NULL", "PRECALL", "KW_NAMES", "RESUME", "COPY_FREE_VARS"})
_UNKNOWN = object()


def _environ_objects() -> dict[int, str]:
    found = {"environ": os.environ, "getenv": os.getenv}
    found.update({k: getattr(os, k) for k in ("environb", "getenvb") if hasattr(os, k)})
    return {id(v): k for k, v in found.items()}


_ENVIRON = _environ_objects()  # id -> name: os.environ and os.getenv, as `from os import environ` binds them


def _environ_reads(code: types.CodeType, scope: dict, bound: dict | None = None) -> tuple[list[str], bool]:
    """The environment variables ``code`` (and the functions nested in it) reads by a constant name
    (``os.environ["K"]``, ``os.environ.get("K")``, ``os.getenv("K")``, ``"K" in os.environ``, and through
    ``from os import environ``), and whether it reads the environment otherwise (a name that is not a
    constant, ``os.environ.items()``, the mapping passed on). Read from the bytecode: what runs, not the
    source. An ``environ`` attribute of something that may be ``os`` counts; one of another known object not."""
    ops = [op for op in dis.get_instructions(code) if op.opname not in _FILLER]
    bound = dict(bound or {})  # names this code binds to os or its members: `import os as o`, `from os import environ`
    for i, op in enumerate(ops[:-1]):
        if op.opname == "IMPORT_NAME" and (op.argval == "os" or str(op.argval).startswith("os.")):
            if ops[i + 1].opname.startswith("STORE_"):
                bound[ops[i + 1].argval] = os
            j = i + 1
            while j + 1 < len(ops) and ops[j].opname == "IMPORT_FROM":
                if ops[j + 1].opname.startswith("STORE_"):
                    bound[ops[j + 1].argval] = getattr(os, ops[j].argval, None)
                j += 2

    def value_of(op: dis.Instruction) -> Any:
        if op.opname not in _LOADS or not isinstance(op.argval, str):
            return _UNKNOWN
        if op.argval in bound:
            return bound[op.argval]
        return scope.get(op.argval, _UNKNOWN) if op.opname in ("LOAD_GLOBAL", "LOAD_NAME") else _UNKNOWN

    def const(at: int) -> str | None:
        op = ops[at] if 0 <= at < len(ops) else None
        return op.argval if op is not None and op.opname == "LOAD_CONST" and isinstance(op.argval, str) else None

    keys, other = [], False
    for i, op in enumerate(ops):
        if op.opname in _ATTRS and op.argval in ("environ", "getenv", "environb", "getenvb"):
            base = value_of(ops[i - 1]) if i else _UNKNOWN
            if base is not os and base is not _UNKNOWN:
                continue  # another object's attribute of that name
            what, start = op.argval, i - 1
        elif op.opname in _LOADS and id(value_of(op)) in _ENVIRON:
            what, start = _ENVIRON[id(value_of(op))], i
        else:
            continue
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        after = ops[i + 2] if i + 2 < len(ops) else None
        subscript = after is not None and (after.opname == "BINARY_SUBSCR" or after.argrepr == "[]")  # 3.14: BINARY_OP
        method = nxt.argval if nxt is not None and nxt.opname in _ATTRS else None
        if what in ("environ", "environb") and after is not None and after.opname in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            continue  # os.environ["K"] = ...: what the code sets is not an input
        if what == "environ" and method in _ENV_WRITES:
            continue
        if what == "getenv" and const(i + 1) is not None:
            keys.append(const(i + 1))
        elif what == "environ" and const(i + 1) is not None and subscript:
            keys.append(const(i + 1))
        elif what == "environ" and method in _ENV_READS and const(i + 2) is not None:
            keys.append(const(i + 2))
        elif what == "environ" and nxt is not None and nxt.opname == "CONTAINS_OP" and const(start - 1) is not None:
            keys.append(const(start - 1))
        else:  # a name that is not a constant, the whole mapping, or bytes (environb, getenvb)
            other = True
    for k in code.co_consts:
        if isinstance(k, types.CodeType):
            more, odd = _environ_reads(k, scope, bound)
            keys, other = keys + more, other or odd
    return list(dict.fromkeys(keys)), other


def _compiled(module: types.ModuleType) -> bool:
    """A builtin or C-extension module (``math``, ``time``): no Python source."""
    path = getattr(module, "__file__", None)
    if path is None:
        return not hasattr(module, "__path__")  # a namespace package has folders, not code
    return path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _plain_data(v: Any, depth: int = 0) -> bool:
    """A number, string, bool or None, or a tuple, list, set or dict of these (a setting's value)."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return True
    if depth >= 4 or not isinstance(v, (tuple, list, set, frozenset, dict)) or len(v) > 1000:
        return False
    items = [*v, *v.values()] if isinstance(v, dict) else v
    return all(_plain_data(x, depth + 1) for x in items)


def _of_yours(v: Any) -> bool:
    """A function, class or object of your own code (not the standard library's or a package's)."""
    if isinstance(v, types.FunctionType):
        return not _in_library(v.__code__.co_filename)
    kind = v if isinstance(v, type) else type(v)
    return not _module_in_library(kind.__module__)


# ---------------------------------------------------------------------- a script's top level
@dataclass(frozen=True, eq=False)
class Script:
    """The top level of a script (or a notebook cell) at the line that made something, a Loop: its code, its
    globals, and a copy of each plain value it names as it was at that line (:func:`script_at`)."""

    code: types.CodeType
    scope: dict  # the module's globals (live)
    line: int  # the line that made it
    values: dict  # name -> a copy of each global the code names whose value is plain data, at that line

    @property
    def name(self) -> str:
        return os.path.basename(self.code.co_filename)


def script_at(frame: types.FrameType) -> Script:
    """A frame running a module's top level (``<module>``), as it is now: what a rank reads later (once,
    on rank 0) is what was set before this line, not what the script sets after it."""
    code, scope = frame.f_code, frame.f_globals
    values = {
        name: copy.deepcopy(scope[name])
        for name in _names(code)
        if not name.startswith("__") and name in scope and _plain_data(scope[name])
    }
    return Script(code, scope, frame.f_lineno, values)


_PURE_CALLS = frozenset({"abs", "bool", "dict", "float", "int", "len", "list", "max", "min", "round", "str", "tuple"})


def _settings(script: Script) -> set[str] | None:
    """The script's settings: the globals it sets, before the line that made the Loop, from constants and
    other settings only (``learning_rate = 6e-4``, ``n_embd = 4 * 96``, ``name = f"gpt-{n_layer}"``). Their
    values at that line are the run's, a configurator's overrides included (nanoGPT's
    ``exec(open('configurator.py').read())``). A global also set from anything else (the environment, the
    clock, the rank, a call: ``seed_offset = ddp_rank``, ``t0 = time.time()``, ``gradient_accumulation_steps
    //= ddp_world_size``), by an import, a loop, a ``with`` or a function (``global``), is not one: it may
    differ between runs or ranks of one run, and an elastic resume at another world size must go on. Nor is
    a list, dict or set the script uses before that line (it may have been changed in place). None: the
    source cannot be read (``python -c``)."""
    lines = linecache.getlines(script.code.co_filename, script.scope)
    try:
        tree = ast.parse("".join(lines)) if lines else None
    except (SyntaxError, ValueError):
        tree = None
    if tree is None:
        return None
    # the statement that made the Loop: a call over several lines reports one of them
    at = script.line
    for node in ast.walk(tree):  # breadth first: the innermost statement holding the line comes last
        if isinstance(node, ast.stmt) and node.lineno <= script.line <= (node.end_lineno or node.lineno):
            at = node.lineno
    nodes = [n for n in _module_level(tree) if getattr(n, "lineno", at) < at]
    assigned: dict[str, list[ast.expr]] = {}
    taken: set[int] = set()  # the Name nodes of assignments read as such
    for st in nodes:
        pairs: list = []
        if isinstance(st, ast.Assign) and st.end_lineno < at:
            pairs = [p for target in st.targets for p in _pairs(target, st.value)]
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign)) and st.value is not None and st.end_lineno < at:
            pairs = _pairs(st.target, st.value)
        for target, value in pairs:
            assigned.setdefault(target.id, []).append(value)
            taken.add(id(target))
    other = {name for node in ast.walk(tree) if isinstance(node, (ast.Global, ast.Nonlocal)) for name in node.names}
    for n in nodes:
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load) and id(n) not in taken:
            other.add(n.id)  # a for target, a with's `as`, a walrus, a del, an unpacked call's result
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            other |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)):
            other.add(n.name or "")
        elif type(n).__name__ in ("MatchAs", "MatchStar", "MatchMapping"):  # a match statement's captures
            other.add(getattr(n, "name", None) or getattr(n, "rest", None) or "")
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.lineno < at}
    other |= {name for name in used if _mutable(script.values.get(name))}
    settings, bound = set(assigned) - other, set(assigned) | other
    changed = True
    while changed:  # a setting is made of settings only: drop those made of anything else, until none is
        changed = False
        for name in sorted(settings):
            if not all(_constant(v, settings, bound) for v in assigned[name]):
                settings.discard(name)
                changed = True
    return settings


def _module_level(node: ast.AST):
    """The nodes under ``node`` that run at a module's top level (not in a function's or class's body)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _module_level(child)


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.Name, ast.expr]]:
    """(name, value) of an assignment: ``a = 1``, ``a, b = 1, 2``; [] where a name's value is not its own
    expression (``a, b = pair``, ``x[0] = 1``)."""
    if isinstance(target, ast.Name):
        return [(target, value)]
    if (
        isinstance(target, (ast.Tuple, ast.List))
        and isinstance(value, (ast.Tuple, ast.List))
        and len(target.elts) == len(value.elts)
        and not any(isinstance(e, ast.Starred) for e in [*target.elts, *value.elts])
    ):
        return [p for t, v in zip(target.elts, value.elts) for p in _pairs(t, v)]
    return []


def _constant(node: ast.AST | None, settings: set[str], bound: set[str]) -> bool:
    """Whether an expression is made of constants and settings only (a call to a builtin such as ``int``
    or ``dict`` of such arguments included, where the script does not bind that name itself)."""
    if node is None or isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id in settings
    if isinstance(node, ast.Call):
        return (
            isinstance(node.func, ast.Name)
            and node.func.id in _PURE_CALLS
            and node.func.id not in bound
            and all(_constant(a, settings, bound) for a in node.args)
            and all(k.arg is not None and _constant(k.value, settings, bound) for k in node.keywords)
        )
    if isinstance(node, ast.Dict) and None in node.keys:  # {**other}
        return False
    kinds = (
        ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp,
        ast.JoinedStr, ast.FormattedValue, ast.Subscript, ast.Slice, ast.operator, ast.unaryop, ast.boolop,
        ast.cmpop, ast.expr_context,
    )  # fmt: skip
    return isinstance(node, kinds) and all(_constant(c, settings, bound) for c in ast.iter_child_nodes(node))


def _mutable(v: Any) -> bool:
    if isinstance(v, (list, dict, set, bytearray)):
        return True
    return isinstance(v, (tuple, frozenset)) and any(_mutable(x) for x in v)


class _Reader:
    """Reads code, objects and data into ``parts`` (label -> text), following references once each."""

    def __init__(self):
        self.parts: dict[str, str] = {}
        self.unproven: list[str] = []
        self._seen: set[int] = set()
        self._open: set[int] = set()  # containers being read: one that holds itself stops there
        self.data = False  # reading a dataset: its file paths are read by size and mtime
        self._read: list[str] = []  # files read by size and mtime, and folders whose file list was read
        self._folders: list[tuple[str, str]] = []  # (label, path) of folders a dataset names
        self._modules_open: set[str] = set()  # modules being read through (pkg.sub.CONST): one naming itself stops
        self._layers: dict[int, str] = {}  # the model's own modules by id -> path: referenced, not read again
        self.read_environ = True  # False: an environment variable code reads is kept apart, not compared (a Loop's)
        self.environ_values: dict[str, str] = {}  # ...and its value kept apart, for a resume to say a change

    def fingerprint(self, name: str) -> Fingerprint:
        return Fingerprint(name, dict(self.parts), tuple(dict.fromkeys(self.unproven)), dict(self.environ_values))

    def _once(self, obj: Any) -> bool:
        if id(obj) in self._seen:
            return False
        self._seen.add(id(obj))
        return True

    # ---------------------------------------------------------------- code
    def callable(self, obj: Any, label: str) -> str:
        """Read what calling ``obj`` runs; returns a short description of it."""
        if isinstance(obj, Script):
            return self.script(obj)
        if isinstance(obj, functools.partial):
            self.parts[f"{label} arguments"] = self.value([obj.args, obj.keywords], f"{label} arguments", 1)
            return f"partial({self.callable(obj.func, label)})"
        if isinstance(obj, types.MethodType):
            if not isinstance(obj.__self__, (nn.Module, type)):  # a model is read as a model, a class as a class
                self.value(obj.__self__, f"{label} self", 1)
            return self.callable(obj.__func__, label)
        if isinstance(obj, types.FunctionType):
            return self.function(obj)
        if isinstance(obj, type):
            return self.cls(obj)
        # a callable object: its class's code and its attributes
        self.parts[f"{label} object"] = self.value(obj, label, 1)
        return type(obj).__qualname__

    def function(self, fn: types.FunctionType) -> str:
        code, name = fn.__code__, f"{_module_of(fn)}.{fn.__qualname__}"
        if _in_library(code.co_filename) or not self._once(fn):
            return name
        label = f"code {fn.__qualname__}"
        if label in self.parts:  # another function of that name (two module-level lambdas): keep both
            label = f"code {fn.__qualname__} (line {code.co_firstlineno})"
        self.parts[label] = _digest(_code(code))[:16]
        self.environ(code, fn.__globals__, fn.__qualname__)
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            self.parts[f"{fn.__qualname__} closure {var}"] = self.value(contents, f"{fn.__qualname__} closure {var}", 1)
        if fn.__defaults__ or fn.__kwdefaults__:
            label = f"{fn.__qualname__} defaults"
            self.parts[label] = self.value([fn.__defaults__, fn.__kwdefaults__], label, 1)
        scope, names = fn.__globals__, _names(code)
        for var in _global_names(code):
            if var not in scope:
                continue
            if isinstance(scope[var], types.ModuleType):
                self.module(scope[var], names)  # (the attributes the code names, on a module of yours)
                continue
            label = f"global {_module_of(fn)}.{var}"
            if label not in self.parts:
                self.parts[label] = "..."  # taken before reading: a function that names itself stops here
                self.parts[label] = self.value(scope[var], label, 1)
        return name

    def module(self, module: types.ModuleType, names: list[str]) -> None:
        """What code reaches through a module of your own (``import mycfg`` ... ``mycfg.SCALE``): each
        name it uses that the module defines (code names attributes and globals alike; one read too
        many is harmless), and through its submodules (``pkg.sub.CONST``). A builtin or C-extension
        module (``math``): see :meth:`compiled_module`."""
        if module.__name__ in self._modules_open:
            return
        if _module_object_in_library(module):
            if _compiled(module) and module.__name__ != "sys":  # sys: the process's own state (argv, path)
                self.compiled_module(module, names)
            return
        self._modules_open.add(module.__name__)
        try:
            own = vars(module)
            for var in names:
                if var not in own or var.startswith("__"):
                    continue
                if isinstance(own[var], types.ModuleType):
                    self.module(own[var], names)
                    continue
                label = f"global {module.__name__}.{var}"
                if label not in self.parts:
                    self.parts[label] = "..."
                    self.parts[label] = self.value(own[var], label, 1)
        finally:
            self._modules_open.discard(module.__name__)

    def compiled_module(self, module: types.ModuleType, names: list[str]) -> None:
        """What code names on a builtin or C-extension module (``math.X``) that holds plain data or is of
        your own code (a value or function set on it by your code, at import) is read like a global value.
        Its own functions and types are named, as before. What it was shipped with cannot be told from what
        was set on it later in the process (a C module keeps no list of its names), so its own constants are
        read too: ``math.pi`` is the same in every run, and never unproven."""
        own = vars(module)
        for var in names:
            value = own.get(var, _ABSENT)
            if var.startswith("__") or value is _ABSENT or not (_plain_data(value) or _of_yours(value)):
                continue
            label = f"global {module.__name__}.{var}"
            if label not in self.parts:
                self.parts[label] = "..."
                self.parts[label] = self.value(value, label, 1)

    def environ(self, code: types.CodeType, scope: dict, who: str) -> None:
        """The environment variables ``code`` reads (:func:`_environ_reads`): each read by a constant name
        is part of the identity, its value or its absence (``os.environ['MUL'] '2'``, ``unset``); kept in
        ``environ_values`` instead, not compared, when ``read_environ`` is off (a Loop's code). One read
        otherwise (a name that is not a constant, the whole mapping) is listed. Where a launcher or ddpkit places a rank
        (``RANK``, ``WORLD_SIZE``, ``SLURM_*``...) is neither: it is not what the run computes."""
        keys, other = _environ_reads(code, scope)
        for key in keys:
            label = f"os.environ[{key!r}]"
            if _PLACEMENT_ENV.fullmatch(key) or label in self.parts:
                continue
            value = os.environ.get(key)
            if value is None:
                shown = "unset"
            elif _SECRET_ENV.search(key) or len(repr(value)) > _TEXT:  # a token is not written to the run dir
                shown = f"set, sha {_digest(value)[:16]}"
            else:
                shown = repr(value)
            if self.read_environ:
                self.parts[label] = shown
            else:  # said once for all of them, on the start line (Loop.resume)
                self.environ_values.setdefault(label, shown)
        if other:
            self.unproven.append(
                f"code {who}: reads the environment other than by a constant name (os.environ[name], "
                f"os.environ.items(), ...), so what it reads is not read"
            )

    def script(self, script: Script) -> str:
        """A script's top level that made a Loop: its code (with every function and class it defines), its
        settings as they were at that line (:func:`_settings`: ``global learning_rate 0.0006``), what it
        reaches of your own elsewhere (functions and classes it imports, your modules' names), and the
        environment variables its functions read. Its other globals (the rank, the clock, objects: a model,
        a device) are the run's own state, not its identity, and are left out; so are environment variables
        read at its top level, which only its globals hold."""
        self.parts[f"code {script.name}"] = _digest(_code(script.code))[:16]
        names, settings = _names(script.code), _settings(script)
        if settings is None:
            self.unproven.append(
                f"the settings of {script.name}: its source cannot be read, so which of its globals are "
                f"settings is unknown (none is read)"
            )
        here = script.scope.get("__name__")
        for var in names:
            value = script.scope.get(var, _ABSENT)
            if var.startswith("__") or value is _ABSENT:
                continue
            if var in script.values:
                if var in (settings or ()):
                    self.parts[f"global {var}"] = self.value(script.values[var], f"global {var}", 1)
            elif isinstance(value, types.ModuleType):
                self.module(value, names)
            elif isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) != here:
                self.callable(value, f"global {var}")  # imported from a module of yours: read there
        for inner in script.code.co_consts:
            if isinstance(inner, types.CodeType):
                self.environ(inner, script.scope, getattr(inner, "co_qualname", inner.co_name))
        return script.name

    def cls(self, klass: type) -> str:
        name = f"{_module_of(klass)}.{klass.__qualname__}"
        if _module_in_library(klass.__module__) or not self._once(klass):
            return name
        for base in klass.__mro__[1:]:
            if base is not object:
                self.cls(base)
        for attr, member in vars(klass).items():
            if attr.startswith("__") and attr not in ("__init__", "__call__", "__getitem__", "__len__", "__iter__"):
                continue
            if attr == "_abc_impl":  # ABCMeta's cache on every subclass of an ABC (IterableDataset's): no code
                continue
            if isinstance(member, property):
                inner = [f for f in (member.fget, member.fset, member.fdel) if f is not None]
            elif isinstance(member, functools.cached_property):
                inner = [member.func]
            else:  # a staticmethod or classmethod: what it wraps (staticmethod(torch.relu) is a builtin)
                inner = [getattr(member, "__func__", member)]
            if all(isinstance(f, types.FunctionType) for f in inner):
                for f in inner:
                    self.function(f)
            else:  # a class attribute: a value, a builtin function or a class it uses
                label = f"class {klass.__qualname__}.{attr}"
                self.parts[label] = self.value(inner[0] if len(inner) == 1 else inner, label, 1)
        return name

    # ---------------------------------------------------------------- values
    def value(self, v: Any, label: str, depth: int) -> str:
        """A readable text for ``v`` (its content for data, its code for code); long texts as a digest."""
        # Containers and objects being read are "open": one that holds itself stops there. Classes and
        # functions are not: each is read once (_once), and a class's method naming the class
        # (super()'s __class__ cell, a global) is a reference, not a loop.
        container = isinstance(v, (list, tuple, set, frozenset, dict)) or (
            hasattr(v, "__dict__") and not isinstance(v, (type, types.FunctionType, types.MethodType, types.ModuleType))
        )
        if depth > 4 * _MAX_DEPTH or (container and id(v) in self._open):
            self.unproven.append(f"{label}: nested too deep (or holds itself) to read")
            return type(v).__name__
        if container:
            self._open.add(id(v))
        try:
            text = self._value(v, label, depth)
        except Exception as exc:  # noqa: BLE001 - a user object's repr or attribute may raise anything
            self.unproven.append(
                f"{label}: {article(type(v).__qualname__)} that could not be read ({type(exc).__name__})"
            )
            text = type(v).__qualname__
        finally:
            self._open.discard(id(v))
        return text if len(text) <= _TEXT else f"{type(v).__name__} sha {_digest(text)[:16]}"

    def _value(self, v: Any, label: str, depth: int) -> str:
        if id(v) in _ENVIRON:  # `from os import environ`: by name; what code reads of it is read by key (environ())
            return f"os.{_ENVIRON[id(v)]}"
        if isinstance(v, torch.device):  # its type only: a rank's own index (cuda:3) is not the run's identity
            return f"device {v.type}"
        if v is None or isinstance(v, (bool, int, float, complex, bytes, range, torch.dtype)):
            return repr(v)
        if isinstance(v, str):
            return self._path(v, repr(v), label) if self.data else repr(v)
        if self.data and isinstance(v, os.PathLike):  # a pathlib.Path: the same as its string
            path = os.fspath(v)
            return self._path(path, repr(v), label) if isinstance(path, str) else repr(v)
        if isinstance(v, torch.Tensor):
            if isinstance(v, nn.Parameter) or v.requires_grad:  # weights: their layout, never their values
                return f"parameter {list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            return _tensor(v)
        if type(v).__module__ == "numpy" and hasattr(v, "tobytes"):
            if getattr(v, "dtype", None) is not None and v.dtype.kind == "O":  # objects: their values, not pointers
                return f"array {list(v.shape)} of objects [{self.value(v.tolist(), label, depth + 1)}]"
            return f"array {list(getattr(v, 'shape', ()))} {v.dtype} sha {hashlib.sha256(v.tobytes()).hexdigest()[:16]}"
        if isinstance(v, (list, tuple, set, frozenset)):
            unordered = isinstance(v, (set, frozenset))
            if len(v) > 64 and all(type(x) in (int, float, bool) for x in v):  # indices, labels: one digest
                items = sorted(v) if unordered else list(v)
                return f"{type(v).__name__} of {len(v)} sha {_digest(repr(items))[:16]}"
            texts = [self.value(x, label, depth + 1) for x in v]
            return f"{type(v).__name__}[{', '.join(sorted(texts) if unordered else texts)}]"
        if isinstance(v, dict):
            return (
                "{"
                + ", ".join(
                    f"{self.value(k, label, depth + 1)}: {self.value(x, label, depth + 1)}" for k, x in v.items()
                )
                + "}"
            )
        if isinstance(v, (types.FunctionType, types.MethodType, functools.partial, type)):
            return self.callable(v, label)
        if callable(v) and isinstance(getattr(v, "__wrapped__", None), types.FunctionType):
            # functools.cache/lru_cache: a C wrapper whose code is the function it wraps (a dunder attribute)
            return self.callable(v.__wrapped__, label)
        if isinstance(v, logging.Logger):
            # By name: its __dict__ reaches the process's whole logger registry (its order and caches differ
            # from process to process), and where a log line goes does not change what is computed
            return f"logger {v.name!r}"
        if isinstance(v, (types.BuiltinFunctionType, types.ModuleType)):
            return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', v.__name__)}"
        if isinstance(v, nn.Module):
            return self._module(v, label, depth)
        if isinstance(v, torch.optim.lr_scheduler.LRScheduler):  # a scheduler's own schedulers (SequentialLR)
            self.scheduler(v, label)
        return self._object(v, label, depth)

    def _object(self, v: Any, label: str, depth: int) -> str:
        kind = type(v)
        mine = not _module_in_library(kind.__module__)
        if mine:
            self.cls(kind)
        state = getattr(v, "__dict__", None)
        if state is not None and depth <= _MAX_DEPTH:
            if not self._once(v):
                return f"{kind.__qualname__} (again)"
            attrs = {k: x for k, x in state.items() if not k.startswith("__")}
            inner = ", ".join(f"{k}={self.value(x, label, depth + 1)}" for k, x in attrs.items())
            return f"{kind.__qualname__}({inner})"
        text = repr(v)
        if " at 0x" not in text and not mine:  # a repr that describes its value (a transform, an Enum, a Path)
            return text
        self.unproven.append(f"{label}: a {kind.__qualname__} whose state ddpkit cannot read")
        return kind.__qualname__

    def _module(self, v: nn.Module, label: str, depth: int) -> str:
        """A module reached by code (a loss's ``nn.CrossEntropyLoss``, a teacher network): its settings
        (:func:`_module_settings`), parameters by shape, buffers by content (a loss's class ``weight=`` is
        an input, not a weight trained), and its children, read alike."""
        if id(v) in self._layers:  # a layer of the model being read (a block keeping its parent): by path
            return f"the model's {self._layers[id(v)] or 'root'}"
        kind = type(v)
        if not _module_in_library(kind.__module__):
            self.cls(kind)
        if depth > 2 * _MAX_DEPTH:  # deeper than any model nests its layers: its structure only
            return f"module sha {_digest(repr(v))[:16]}"
        if not self._once(v):
            return f"{kind.__qualname__} (again)"
        items = [f"{k}={self.value(x, label, depth + 1)}" for k, x in _module_settings(v)]
        items += [f"{k}={self.value(p, label, depth + 1)}" for k, p in v._parameters.items()]
        items += [f"{k}={'None' if b is None else _tensor(b)}" for k, b in v._buffers.items()]
        items += [f"{k}={self.value(m, label, depth + 1)}" for k, m in v._modules.items()]
        return f"{kind.__qualname__}({', '.join(items)})"

    def _path(self, path: str, text: str, label: str) -> str:
        """A path a dataset names: a file by what is there now (:meth:`_file`); a folder by its name,
        noted for :meth:`folders_unread`."""
        if _is_file(path):
            return self._file(path)
        if _is_folder(path):
            self._folders.append((label, path))
        return text

    def _file(self, path: str) -> str:
        """A file named by a dataset, by what is there now: its size and modification time. Folders are
        not listed (one may hold logs, caches or the run dir itself): a dataset that lists a folder keeps
        the list (as ImageFolder's ``samples``), and that is read."""
        st = os.stat(path)
        self._read.append(os.path.realpath(path))
        return f"{path!r} ({st.st_size} bytes, mtime {st.st_mtime_ns})"

    def folders_unread(self) -> None:
        """Each folder a dataset names of which no file was read (a dataset that keeps only its folder's
        path and opens files by name in ``__getitem__``): an edit there changes nothing ddpkit reads, so it
        goes to ``unproven``, never to "data by content"."""
        read = [os.path.join(p, "") for p in self._read]  # a trailing separator: /data/a is not in /data/ab
        for label, path in self._folders:
            folder = os.path.join(os.path.realpath(path), "")
            if not any(p.startswith(folder) or folder.startswith(p) for p in read):
                self.unproven.append(
                    f"{label}: the folder {path!r} is read by name only, not its files (ddpkit lists no folder: "
                    f"keep the list of files in the dataset to have them read)"
                )

    def scheduler(self, sched: Any, label: str) -> None:
        """A scheduler's code: its class, its lr lambdas, and the schedulers it runs (SequentialLR...)."""
        self.cls(type(sched))
        for fn in list(getattr(sched, "lr_lambdas", None) or []) + [getattr(sched, "lr_lambda", None)]:
            if fn is not None:
                self.parts.setdefault(f"{label} lr_lambda", self.callable(fn, f"{label} lr_lambda"))
        for i, inner in enumerate(getattr(sched, "_schedulers", None) or []):
            self.parts[f"{label} scheduler {i}"] = type(inner).__name__
            self.scheduler(inner, f"{label} scheduler {i}")

    # ---------------------------------------------------------------- data
    def dataset(self, data: Any, label: str) -> None:
        from torch.utils.data import ConcatDataset, Subset

        if data is None:
            self.parts[label] = "none"
            return
        self.data = True
        self.parts[label] = f"{type(data).__qualname__}, {len(data)} samples"
        if isinstance(data, Subset):
            self.parts[f"{label} indices"] = self.value(list(data.indices), f"{label} indices", 1)
            self.dataset(data.dataset, f"{label} of")
            return
        if isinstance(data, ConcatDataset):
            for i, part in enumerate(data.datasets):
                self.dataset(part, f"{label} part {i}")
            return
        samples = getattr(data, "samples", None)
        if isinstance(samples, list) and samples and isinstance(samples[0], tuple) and hasattr(data, "root"):
            try:  # torchvision's ImageFolder/DatasetFolder, ddpkit's image folders
                self.parts[f"{label} files"] = _files(samples, str(data.root))
                self._read.append(os.path.realpath(data.root))  # its folder's files: read
            except OSError as exc:
                self.unproven.append(f"{label} files: {exc.filename}: {exc.strerror}")
            except (TypeError, ValueError) as exc:  # samples of another shape than (path, target)
                self.unproven.append(f"{label} files: samples ddpkit cannot read as (path, target) ({exc})")
            rest = {k: x for k, x in vars(data).items() if k not in ("samples", "imgs", "targets")}
        else:
            rest = dict(getattr(data, "__dict__", {}))
        if not _module_in_library(type(data).__module__):
            self.cls(type(data))
        for k, x in rest.items():
            if not k.startswith("__"):
                self.parts[f"{label}.{k}"] = self.value(x, f"{label}.{k}", 1)


def _is_file(text: str) -> bool:
    return 0 < len(text) < 4096 and "\0" not in text and os.path.isfile(text)


def _is_folder(text: str) -> bool:
    return 0 < len(text) < 4096 and "\0" not in text and os.path.isdir(text)


def _tensor(t: torch.Tensor) -> str:
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"tensor {list(t.shape)} {str(t.dtype).removeprefix('torch.')} sha {hashlib.sha256(data).hexdigest()[:16]}"


def _files(samples: list, root: str) -> str:
    rows = []
    for path, target in samples:
        st = os.stat(path)
        rows.append([os.path.relpath(path, root), target, st.st_size, st.st_mtime_ns])
    return f"{len(rows)} files sha {_digest(rows)[:16]}"


# ---------------------------------------------------------------------- what the Trainer calls
def code_digest(fn: Any) -> str:
    """8 hex digits of what calling ``fn`` runs (see the module docstring)."""
    reader = _Reader()
    reader.parts["fn"] = reader.callable(fn, "fn")
    return _digest(reader.parts)[:8]


def code_name(obj: Any) -> str:
    """A function's or class's qualified name, or a callable object's class name."""
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


def model_fingerprint(model: nn.Module) -> Fingerprint:
    reader = _Reader()
    layout = [(k, list(v.shape), str(v.dtype)) for k, v in model.state_dict().items()]
    count = sum(v.numel() for v in model.parameters())
    shape = _digest([layout, repr(model)])[:16]
    reader.parts["structure"] = f"{count:,} parameters in {len(layout)} tensors, sha {shape}"
    reader._layers = {id(m): path for path, m in model.named_modules()}
    for path, module in model.named_modules():
        if not _module_in_library(type(module).__module__):
            reader.cls(type(module))
        for k, x in _module_settings(module):  # a part each: a refusal names the layer and the setting
            label = f"{path or type(model).__name__}.{k}"
            reader.parts[label] = reader.value(x, label, 1)
    return reader.fingerprint(type(model).__name__)


def data_fingerprint(
    train: Any, test: Any, collate_fn: Any = None, meta: Any = None, worker_init_fn: Any = None, val: Any = None
) -> Fingerprint:
    """The data's content; with ``collate_fn`` and ``worker_init_fn`` (their code), ``meta`` (its fields) and a
    validation split when they are given: parts only then, so data passed without them keeps the tag older
    ddpkit gave it."""
    reader = _Reader()
    reader.dataset(train, "train")
    reader.dataset(test, "test")
    if val is not None:
        reader.dataset(val, "val")
    reader.folders_unread()
    reader.data = False  # what follows is code and settings, not files
    if collate_fn is not None:
        reader.parts["collate code"] = reader.callable(collate_fn, "collate")
    if worker_init_fn is not None:
        reader.parts["worker_init code"] = reader.callable(worker_init_fn, "worker_init")
    if dataclasses.is_dataclass(meta) and not isinstance(meta, type):
        for f in dataclasses.fields(meta):
            reader.parts[f"meta {f.name}"] = reader.value(getattr(meta, f.name), f"meta {f.name}", 1)
    elif meta is not None:
        reader.parts["meta"] = reader.value(meta, "meta", 1)
    return reader.fingerprint(type(train if train is not None else test).__name__)


def with_code(fp: Fingerprint, label: str, fn: Any) -> Fingerprint:
    """``fp`` plus what ``fn`` runs (the function an import path names: its code, the names it reaches)."""
    reader = _Reader()
    reader.parts[label] = reader.callable(fn, label)  # the reader files the code it reads under parts too
    return Fingerprint(fp.name, {**fp.parts, **reader.parts}, tuple(fp.unproven) + tuple(reader.unproven))


def code_fingerprint(name: str, callables: dict, read_environ: bool = True) -> Fingerprint:
    """What each of ``callables`` ({label: fn}, e.g. the loss and the metrics; or a :class:`Script`) runs.
    ``read_environ=False`` (a Loop's code): the environment variables it reads are not compared: a loop's own
    code reads them for how to run (``SAVE``, when to stop, test hooks), which may change between a run and its
    resume. Their values are kept in ``environ``, for the resume to say a change (``LR=0.5`` on a rerun of an
    ``LR=0.01`` run trains on at the snapshot's lr: the porter's seed-000 port)."""
    reader = _Reader()
    reader.read_environ = read_environ
    for label, fn in callables.items():
        reader.parts[label] = reader.callable(fn, label)
    return reader.fingerprint(name)


_WORKER_ONLY = re.compile(r"process group|cuda|device", re.IGNORECASE)


def optimizer_fingerprint(spec: Any, model: nn.Module | None) -> tuple[Fingerprint, torch.optim.Optimizer | None]:
    """An optimizer, or a factory ``fn(model)`` (called once on ``model`` to read what it builds);
    returns the fingerprint and the optimizer read."""
    import copy

    reader = _Reader()
    opt = spec
    if not isinstance(spec, torch.optim.Optimizer):
        reader.parts["factory"] = reader.callable(spec, "factory")
        if model is None:
            return reader.fingerprint(code_name(spec)), None
        model = copy.deepcopy(model)  # a factory may move or freeze what it is given: never yours
        try:
            opt = spec(model)
        except Exception as exc:  # noqa: BLE001 - your factory's own code
            # What only a worker can build (ZeroRedundancyOptimizer needs the process group; a CUDA-only
            # optimizer needs the model on its GPU) is left to the workers; anything else is a mistake.
            if not _WORKER_ONLY.search(str(exc)):
                raise ConfigError(f"the optimizer factory {code_name(spec)} raised {raised_at(exc)}") from None
            reader.unproven.append(f"the optimizer factory could not be called before launch ({type(exc).__name__})")
            return reader.fingerprint(code_name(spec)), None
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"the optimizer factory {code_name(spec)} returned {type(opt).__name__}; it must return a "
                f"torch.optim.Optimizer built on the model it is given: optimizer=lambda model: "
                f"torch.optim.AdamW(model.parameters(), lr=3e-4)"
            )
    reader.cls(type(opt))
    index = {id(p): i for i, p in enumerate(model.parameters())} if model is not None else {}
    for i, group in enumerate(opt.param_groups):
        settings = {k: (float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in group.items()}
        params = settings.pop("params")
        reader.parts[f"group {i}"] = f"{len(params)} tensors"
        for k, v in sorted(settings.items()):
            reader.parts[f"group {i} {k}"] = reader.value(v, f"group {i} {k}", 1)
        reader.parts[f"group {i} params"] = _digest([index.get(id(p), -1) for p in params])[:16]
    if opt.state:
        reader.parts["state"] = reader.value(opt.state_dict()["state"], "state", 1)
    return reader.fingerprint(type(opt).__name__), opt


def scheduler_fingerprint(spec: Any, opt: torch.optim.Optimizer | None) -> Fingerprint:
    """A scheduler, or a factory ``fn(optimizer[, total_steps])`` (called once, on a copy of ``opt``'s
    parameter groups, with a nominal 1000 steps, to read its state at step 0)."""
    reader = _Reader()
    sched = spec
    if not (hasattr(spec, "step") and hasattr(spec, "state_dict")):
        reader.parts["factory"] = reader.callable(spec, "factory")
        if opt is None:
            return reader.fingerprint(code_name(spec))
        import copy
        import inspect
        from collections import defaultdict

        probe = copy.copy(opt)  # the scheduler sets lr and initial_lr on its optimizer: never on yours
        # the group values copied too: a tensor lr is changed in place (fill_) by the scheduler
        probe.param_groups = [
            {k: v if k == "params" else copy.deepcopy(v) for k, v in g.items()} for g in opt.param_groups
        ]
        probe.state = defaultdict(dict)
        params = [
            p
            for p in inspect.signature(spec).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        sched = spec(probe, _SCHEDULE_PROBE_STEPS) if len(params) >= 2 else spec(probe)
    reader.scheduler(sched, "scheduler")
    state = {
        k: v
        for k, v in sched.state_dict().items()
        if k not in ("lr_lambdas", "_get_lr_called_within_step", "_schedulers")
    }
    for k, v in sorted(state.items()):
        reader.parts[f"state at step 0: {k}"] = reader.value(v, k, 1)
    return reader.fingerprint(type(sched).__name__)


def file_fingerprint(path: str) -> str:
    """A file's SHA-256 (``--init-from``: the weights a run starts from)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def probe_optimizer(model: nn.Module | None) -> torch.optim.Optimizer:
    """An optimizer to call a scheduler factory on when ddpkit builds the optimizer (lr 1: the
    scheduler's own factors are what is read)."""
    params = list(model.parameters()) if model is not None else []
    return torch.optim.SGD(params or [torch.zeros(1, requires_grad=True)], lr=1.0)


def running_code(frame) -> types.FunctionType | Script:
    """What is running ``frame`` (what the run identity reads): a function, rebuilt from its code, globals
    and closure; or a script's top level (``<module>``: nanoGPT's train.py), its code and the settings it
    has set by this line, copied now (``identity.script_at``)."""
    code = frame.f_code
    if code.co_name == "<module>":
        return script_at(frame)
    cells = tuple(types.CellType(frame.f_locals.get(name)) for name in code.co_freevars)
    return types.FunctionType(code, frame.f_globals, code.co_name, None, cells or None)


def loop_code(ctx, maker: types.FunctionType | Script) -> dict:
    """A ``ddpkit.Loop``'s run identity: the code of the function or the script that made it
    (:func:`running_code`), as global rank 0 read it; every rank uses rank 0's, so all decide alike (``ctx``:
    a ``ranks.context.DistContext``; one broadcast). An environment variable the code reads is recorded under
    ``environ``, not compared (``SAVE``, a test's ``DIE_AT``): a resume says a changed one."""
    mine = None
    if ctx.is_main or ctx.world_size == 1:
        name = maker.name if isinstance(maker, Script) else maker.__qualname__
        mine = code_fingerprint(name, {"loop": maker}, read_environ=False).to_json()
    if ctx.world_size > 1:
        box = [mine]
        dist.broadcast_object_list(box, src=0)
        mine = box[0]
    return mine
