"""A size-bounded, guarded `repr` for trace values (runs inside the sandboxed child).

    from codi.tracing.saferepr import saferepr
    saferepr([1, "a" * 10**7], limit=40)   # "[1, 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa<cut>"

For the builtin types it walks, the result is `repr(x)` when that has at most `limit` characters, else
its first `limit - len(REPR_CUT)` characters followed by REPR_CUT, at O(limit) cost. Anything else uses
its own `__repr__`, guarded (`<repr error: ValueError>`), with addresses normalised to `0x?`.
The types and the guards: docs/design/sandbox.md, "saferepr".
"""

from __future__ import annotations

import array
import builtins
import collections
import heapq
import operator

from codi.tracing.format import REPR_CUT

# The program runs in this same process and may rebind `builtins.len`, `repr`, ...: every function
# of this module is created with a private snapshot of the builtins, so it cannot be reached.
__builtins__ = dict(builtins.__dict__)

ADDRESS = "0x?"
INT_MAX_BITS = 13_000  # ~3900 digits: under Python's 4300-digit str() limit, and cheap to convert
_HEX = frozenset("0123456789abcdefABCDEF")
_nlargest = heapq.nlargest
_by_count = operator.itemgetter(1)
_deque, _defaultdict, _OrderedDict, _Counter = (
    collections.deque, collections.defaultdict, collections.OrderedDict, collections.Counter)
_array = array.array
_NT_REPR_CODE = collections.namedtuple("_P", "x").__repr__.__code__
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
# OrderedDict's repr changed in 3.12 from a list of pairs to a dict literal.
_ODICT_AS_LIST = repr(_OrderedDict(a=1)).startswith("OrderedDict([")


class _Out:
    """The pieces written so far and whether the budget is spent (`n > limit`)."""

    __slots__ = ("parts", "n", "limit", "full")

    def __init__(self, limit: int) -> None:
        self.parts: list[str] = []
        self.n = 0
        self.limit = limit
        self.full = False

    def put(self, text: str) -> None:
        self.parts.append(text)
        self.n += len(text)
        if self.n > self.limit:
            self.full = True

    def room(self) -> int:
        """Characters that may still be written before the result must be cut (+1 to see the cut)."""
        return self.limit - self.n + 1


def saferepr(obj: object, limit: int) -> str:
    """`repr(obj)` of at most `limit` characters (cut ones end in REPR_CUT); never raises."""
    t = type(obj)
    # Fast paths for the values most locals hold.
    if t is int and -(1 << 64) < obj < (1 << 64) or t is float or t is bool or obj is None:
        text = repr(obj)
        return text if len(text) <= limit else text[:limit - len(REPR_CUT)] + REPR_CUT
    if t is str and len(obj) <= limit:
        text = repr(obj)
        return text if len(text) <= limit else text[:limit - len(REPR_CUT)] + REPR_CUT
    out = _Out(limit)
    try:
        _walk(obj, out)
    except BaseException as e:  # noqa: BLE001 - a hostile value must never break the tracer
        return _cut(_error_marker(e), limit)
    text = "".join(out.parts)
    return text if out.n <= limit else text[:limit - len(REPR_CUT)] + REPR_CUT


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - len(REPR_CUT)] + REPR_CUT


def _error_marker(e: BaseException) -> str:
    try:
        name = type(e).__name__
        name = name if type(name) is str else "?"
    except BaseException:  # noqa: BLE001
        name = "?"
    return f"<repr error: {name}>"


def _walk(obj: object, out: _Out) -> None:
    """Write obj's repr into out until the budget is spent; containers are walked without recursion.

    Each container renderer is a generator that writes its own punctuation and yields the children
    to render next; the driver keeps them on an explicit stack, innermost last."""
    active: set[int] = set()  # ids of containers being written (a self-reference prints "[...]")
    stack = []
    child = obj
    while True:
        gen = _start(child, out, active)
        if gen is not None:
            stack.append(gen)
        while stack and not out.full:
            try:
                child = next(stack[-1])
                break
            except StopIteration:
                stack.pop()
        if out.full or not stack:
            return


def _start(obj: object, out: _Out, active: set[int]):
    """Write a leaf's repr, or return the generator that writes a container's."""
    t = type(obj)
    if t is int or t is bool or t is float or obj is None:
        if t is int and obj.bit_length() > INT_MAX_BITS:
            out.put(f"<int of {obj.bit_length()} bits>")
        else:
            out.put(repr(obj))
        return None
    if t is str:
        out.put(_repr_str(obj, out.room()))
        return None
    if id(obj) in active:
        out.put(_recursion_text(obj, t))
        return None
    try:
        r = t.__repr__
    except BaseException:  # noqa: BLE001 - a metaclass that fails attribute lookup
        r = None
    if r is list.__repr__:
        return _seq(obj, out, active, "[", "]", False)
    if r is tuple.__repr__:
        return _seq(obj, out, active, "(", ")", True)
    if r is dict.__repr__:
        return _mapping(obj, out, active, "{", "}", dict.items(obj))
    if r is set.__repr__ or r is frozenset.__repr__:
        return _set(obj, out, active, t)
    if r is str.__repr__:
        out.put(_repr_str(str.__str__(obj), out.room()))
        return None
    if r is int.__repr__:
        n = int.__int__(obj)
        out.put(f"<int of {n.bit_length()} bits>" if n.bit_length() > INT_MAX_BITS else int.__repr__(n))
        return None
    if r is bytes.__repr__:
        out.put(_repr_bytes(obj, out.room()))
        return None
    if r is bytearray.__repr__:
        return _bytearray(obj, out, t)
    if r is _deque.__repr__:
        return _deque_gen(obj, out, active, t)
    if r is _defaultdict.__repr__:
        return _defaultdict_gen(obj, out, active, t)
    if r is _OrderedDict.__repr__:
        return _odict(obj, out, active, t)
    if r is _Counter.__repr__ and t.most_common is _Counter.most_common:
        return _counter(obj, out, active, t)
    if t in _DICT_VIEWS:
        return _view(obj, out, active, t)
    if r is _array.__repr__:
        return _array_gen(obj, out)
    if r is BaseException.__repr__:
        return _exception(obj, out, active, t)
    if getattr(r, "__code__", None) is _NT_REPR_CODE and issubclass(t, tuple):
        return _namedtuple(obj, out, active, t)
    out.put(_opaque(obj))
    return None


def _recursion_text(obj: object, t: type) -> str:
    """What CPython writes for a container met again while it is being written."""
    if issubclass(t, (list, _deque)):
        return "[...]"
    if issubclass(t, _OrderedDict):
        return "..."
    if issubclass(t, _defaultdict):  # its repr re-enters only the dict part
        factory = obj.default_factory
        return f"{t.__name__}({'None' if factory is None else _opaque(factory)}, {{...}})"
    if issubclass(t, dict):
        return "{...}"
    if issubclass(t, tuple):
        return "(...)"
    if issubclass(t, (set, frozenset)):
        return f"{t.__name__}(...)"
    return "..."


def _opaque(obj: object) -> str:
    """The object's own repr, guarded, with addresses normalised and surrogates escaped."""
    try:
        text = repr(obj)
    except BaseException as e:  # noqa: BLE001 - the program must never see it
        return _error_marker(e)
    if " at 0x" in text:
        text = normalise_addresses(text)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def normalise_addresses(text: str) -> str:
    """Replace the hex digits of every " at 0x<hex>" (a default repr's address) by ADDRESS."""
    parts, pos = [], 0
    while True:
        i = text.find(" at 0x", pos)
        if i < 0:
            break
        j = i + 6
        while j < len(text) and text[j] in _HEX:
            j += 1
        if j > i + 6:
            parts.append(text[pos:i + 4])
            parts.append(ADDRESS)
        else:
            parts.append(text[pos:j])
        pos = j
    parts.append(text[pos:])
    return "".join(parts)


def _quote_prefix(head: str | bytes, whole: str | bytes, sq, dq) -> str:
    """The repr of `whole` up to the end of `head` (no closing quote): repr picks its quote from
    the whole value, so one sentinel character forces the same choice on the head."""
    if sq in whole and dq not in whole:
        return repr(head + sq)[:-2]  # whole is written "..." ; head + ' is too
    return repr(head + dq)[:-2]      # whole is written '...' ; head + " is too


def _repr_str(s: str, room: int) -> str:
    if len(s) <= room:
        return repr(s)
    return _quote_prefix(s[:room], s, "'", '"')


def _repr_bytes(b: bytes, room: int) -> str:
    if len(b) <= room:
        return repr(bytes(b))
    return _quote_prefix(bytes(b[:room]), b, b"'", b'"')


def _seq(obj, out: _Out, active: set[int], open_: str, close: str, is_tuple: bool):
    active.add(id(obj))
    out.put(open_)
    n = 0
    for item in obj:
        if n:
            out.put(", ")
        n += 1
        yield item
    out.put(",)" if is_tuple and n == 1 else close)
    active.discard(id(obj))


def _pairs(out: _Out, pairs):
    """Yield the children of `k: v` items, writing the separators."""
    first = True
    for k, v in pairs:
        if not first:
            out.put(", ")
        first = False
        yield k
        out.put(": ")
        yield v


def _mapping(obj, out: _Out, active: set[int], open_: str, close: str, items):
    active.add(id(obj))
    out.put(open_)
    yield from _pairs(out, items)
    out.put(close)
    active.discard(id(obj))


def _set(obj, out: _Out, active: set[int], t: type):
    exact = t is set
    if not obj:
        out.put(f"{t.__name__}()")
        return
    active.add(id(obj))
    out.put("{" if exact else f"{t.__name__}({{")
    first = True
    for item in obj:
        if not first:
            out.put(", ")
        first = False
        yield item
    out.put("}" if exact else "})")
    active.discard(id(obj))


def _bytearray(obj, out: _Out, t: type):
    out.put(f"{t.__name__}(")
    out.put(_repr_bytes(obj, out.room()))
    out.put(")")
    return
    yield  # a generator, like the other renderers


def _deque_gen(obj, out: _Out, active: set[int], t: type):
    out.put(f"{t.__name__}(")
    yield from _seq(obj, out, active, "[", "]", False)
    out.put(")" if obj.maxlen is None else f", maxlen={obj.maxlen})")


def _defaultdict_gen(obj, out: _Out, active: set[int], t: type):
    out.put(f"{t.__name__}(")
    factory = obj.default_factory
    if factory is None:
        out.put("None")
    elif id(factory) in active:
        out.put("...")
    else:
        yield factory
    out.put(", ")
    yield from _mapping(obj, out, active, "{", "}", dict.items(obj))
    out.put(")")


def _odict(obj, out: _Out, active: set[int], t: type):
    if not obj:
        out.put(f"{t.__name__}()")
        return
    out.put(f"{t.__name__}(")
    if _ODICT_AS_LIST:
        active.add(id(obj))
        out.put("[")
        first = True
        for k, v in obj.items():
            out.put("(" if first else ", (")
            first = False
            yield k
            out.put(", ")
            yield v
            out.put(")")
        out.put("]")
        active.discard(id(obj))
    else:
        yield from _mapping(obj, out, active, "{", "}", obj.items())
    out.put(")")


def _counter(obj, out: _Out, active: set[int], t: type):
    if not obj:
        out.put(f"{t.__name__}()")
        return
    # Counter's repr lists most_common() order; only the first items can fit in the budget, and
    # nlargest(k) is documented to equal sorted(..., reverse=True)[:k], ties in insertion order.
    k = out.room() // 4 + 2  # every item takes >= 4 characters ("k: v") with its separator
    try:
        items = _nlargest(k, dict.items(obj), key=_by_count)
    except TypeError:  # unorderable counts: Counter's repr falls back to dict order
        items = dict.items(obj)
    out.put(f"{t.__name__}(")
    yield from _mapping(obj, out, active, "{", "}", items)
    out.put(")")


def _view(obj, out: _Out, active: set[int], t: type):
    out.put(f"{t.__name__}(")
    if t is _DICT_VIEWS[2]:
        out.put("[")
        first = True
        for k, v in obj:
            out.put("(" if first else ", (")
            first = False
            yield k
            out.put(", ")
            yield v
            out.put(")")
        out.put("]")
    else:
        yield from _seq(obj, out, active, "[", "]", False)
    out.put(")")


def _array_gen(obj, out: _Out):
    code = obj.typecode
    if not len(obj):
        out.put(f"array('{code}')")
        return
    out.put(f"array('{code}', ")
    if code == "u":
        out.put(_repr_str(obj.tounicode(), out.room()))
    else:
        out.put("[")
        first = True
        for x in obj:
            if not first:
                out.put(", ")
            first = False
            yield x
        out.put("]")
    out.put(")")


def _exception(obj, out: _Out, active: set[int], t: type):
    args = obj.args
    out.put(t.__name__)
    if type(args) is tuple and len(args) == 1:
        out.put("(")
        yield args[0]
        out.put(")")
    else:
        yield args


def _namedtuple(obj, out: _Out, active: set[int], t: type):
    out.put(f"{t.__name__}(")
    for i, (name, value) in enumerate(zip(t._fields, obj)):
        out.put(f"{name}=" if i == 0 else f", {name}=")
        yield value
    out.put(")")
