"""Strict YAML: bytes → a small tree of nodes that remember their line, or one clear error.

PyYAML's ``safe_load`` is not strict enough for a file that gates CI (RELIABILITY.md group D): it
keeps the last of duplicate keys, expands billion-laughs aliases, turns ``yes`` into ``True`` and
``010`` into ``8``, and its C loader segfaults on deep nesting. So we never let PyYAML construct
Python values. We walk the *event* stream of the pure-Python parser (a ``yaml.SafeLoader``
subclass; its parser is a state machine, not recursive) and build the tree ourselves with an
explicit stack, refusing as we go, before anything is expanded:

- anchors, aliases and explicit tags (``!!python/object/apply:...``): refused at the first event;
- nesting deeper than :data:`MAX_DEPTH`, more than :data:`MAX_NODES` values: refused at the
  event that crosses the limit;
- more than one document, an empty document, a top level that is not a mapping;
- duplicate keys (with both lines), keys that are not plain strings.

Before parsing, the raw bytes are checked: at most :data:`MAX_BYTES`, strict UTF-8 (a leading
UTF-8 byte-order mark is accepted and dropped: the YAML spec allows it and Windows editors write
it; UTF-16/32 are refused), and no tab characters anywhere (YAML forbids them in indentation;
we refuse them everywhere so the rule is one sentence).

Scalars stay *text* here (:class:`Scalar` keeps whether it was quoted); what a scalar means is
decided by the reader that knows which type the key expects (:mod:`shardctl.manifest.values`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from shardctl.errors import ManifestError

# Real manifests are a few KiB, nest 4 deep (model.rope_scaling, rules[i].parts) and hold a few
# hundred values. The caps keep the pure-Python parser (~1 µs per character, ~20 µs per value)
# under half a second on anything hostile.
MAX_BYTES = 256 << 10
MAX_DEPTH = 32
MAX_NODES = 10_000
_BOM = "\ufeff"


class StrictLoader(yaml.SafeLoader):
    """The pure-Python safe parser. We only ever pull *events* from it, never constructed objects.

    Subclassed so no caller can register constructors on the shared ``yaml.SafeLoader``.
    """


@dataclass(frozen=True)
class Scalar:
    """A scalar as written: ``text``, and ``plain`` is False when it was quoted or a block."""

    text: str
    plain: bool
    line: int  # 1-based


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]
    line: int


@dataclass(frozen=True)
class Map:
    """Keys in file order; ``key_lines`` gives the line of each key."""

    entries: dict[str, Node]
    key_lines: dict[str, int]
    line: int


Node = Scalar | Seq | Map


@dataclass
class _Open:
    """A collection being built: a mapping waits for its key/value pairs."""

    kind: str  # "map" | "seq"
    line: int
    items: list[Node] = field(default_factory=list)
    entries: dict[str, Node] = field(default_factory=dict)
    key_lines: dict[str, int] = field(default_factory=dict)
    pending_key: tuple[str, int] | None = None


def check_size(size: int, *, source: str, unit: str = "bytes") -> None:
    if size > MAX_BYTES:
        raise ManifestError(
            f"manifest is {size} {unit}, over the {MAX_BYTES}-byte limit",
            where=source,
            hint="a manifest is a few KiB; check that this is the right file",
        )


def decode(data: bytes, *, source: str) -> str:
    """Size cap, strict UTF-8 (leading BOM dropped), no tabs, not empty."""
    check_size(len(data), source=source)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ManifestError(
            "file is UTF-16 or UTF-32 encoded", where=source, hint="save it as UTF-8"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ManifestError(
            f"not valid UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start} (line {line})",
            where=source,
            hint="save the manifest as UTF-8",
        ) from None
    return check_text(text, source=source)


def check_text(text: str, *, source: str) -> str:
    check_size(len(text), source=source, unit="characters")
    if text.startswith(_BOM):
        text = text[1:]
    tab = text.find("\t")
    if tab >= 0:
        line = text.count("\n", 0, tab) + 1
        column = tab - (text.rfind("\n", 0, tab) + 1) + 1
        raise ManifestError(
            f"tab character at line {line}, column {column}",
            where=source,
            hint="YAML indentation must use spaces; replace tabs with spaces",
        )
    if not text.strip():
        raise ManifestError(
            "empty manifest", where=source, hint="a manifest needs at least a 'model:' section"
        )
    return text


def parse(text: str, *, source: str) -> Map:
    """Text → the top-level mapping. Raises :class:`ManifestError` for anything non-strict."""
    text = check_text(text, source=source)
    try:
        return _build(text, source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        what = exc.problem or exc.context or "syntax error"
        raise ManifestError(f"invalid YAML: {what}{where}", where=source) from None
    except yaml.reader.ReaderError as exc:  # control characters and the like
        line = text.count("\n", 0, exc.position) + 1
        raise ManifestError(
            f"invalid YAML: character #x{exc.character:04x} not allowed (line {line})",
            where=source,
            hint="remove control characters",
        ) from None
    except yaml.YAMLError as exc:  # reader errors: control characters and the like
        raise ManifestError(f"invalid YAML: {' '.join(str(exc).split())}", where=source) from None
    except RecursionError:  # defensive: the walk below is iterative
        raise ManifestError(f"nesting too deep (limit {MAX_DEPTH})", where=source) from None


def _build(text: str, source: str) -> Map:
    loader = StrictLoader(text)
    stack: list[_Open] = []
    root: Node | None = None
    documents = 0
    nodes = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise ManifestError(
                        f"more than one YAML document (second starts at line {line})",
                        where=source,
                        hint="a manifest is one document; remove the '---' separator",
                    )
                continue
            if isinstance(event, yaml.AliasEvent):
                raise ManifestError(
                    f"anchors/aliases not allowed (alias *{event.anchor} at line {line})",
                    where=source,
                    hint="write the value out in full",
                )
            if not isinstance(event, yaml.NodeEvent | yaml.CollectionEndEvent):
                continue  # stream and document boundaries
            if isinstance(event, yaml.NodeEvent):
                _refuse_anchor_and_tag(event, line, source)
                nodes += 1
                if nodes > MAX_NODES:
                    raise ManifestError(
                        f"more than {MAX_NODES} values (line {line})",
                        where=source,
                        hint="a manifest holds a few hundred; check the file",
                    )
            node: Node | None = None
            if isinstance(event, yaml.ScalarEvent):
                node = Scalar(event.value, plain=event.style is None, line=line)
            elif isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
                if len(stack) >= MAX_DEPTH:
                    raise ManifestError(
                        f"nesting deeper than {MAX_DEPTH} levels (line {line})",
                        where=source,
                        hint="a manifest nests a few levels; check the file",
                    )
                kind = "map" if isinstance(event, yaml.MappingStartEvent) else "seq"
                stack.append(_Open(kind, line))
                continue
            else:  # collection end
                done = stack.pop()
                node = (
                    Map(done.entries, done.key_lines, done.line)
                    if done.kind == "map"
                    else Seq(tuple(done.items), done.line)
                )
            if not stack:
                root = node
            else:
                _attach(stack[-1], node, line, stack, source)
    finally:
        loader.dispose()
    if root is None or (isinstance(root, Scalar) and root.plain and root.text in ("", "~", "null")):
        raise ManifestError(
            "empty manifest", where=source, hint="a manifest needs at least a 'model:' section"
        )
    if not isinstance(root, Map):
        got = "a list" if isinstance(root, Seq) else f"the scalar {root.text!r}"
        raise ManifestError(
            f"expected a mapping of sections at the top level, got {got} (line {root.line})",
            where=source,
        )
    return root


def _refuse_anchor_and_tag(event: yaml.NodeEvent, line: int, source: str) -> None:
    if event.anchor is not None:
        raise ManifestError(
            f"anchors/aliases not allowed (anchor &{event.anchor} at line {line})",
            where=source,
            hint="write the value out in full",
        )
    tag = getattr(event, "tag", None)
    if tag is not None:
        raise ManifestError(
            f"YAML tags not allowed ({tag!r} at line {line})",
            where=source,
            hint="remove the tag; values are typed by the key they belong to",
        )


def _attach(parent: _Open, node: Node, line: int, stack: list[_Open], source: str) -> None:
    if parent.kind == "seq":
        parent.items.append(node)
        return
    if parent.pending_key is None:
        if not isinstance(node, Scalar) or node.text == "":
            got = "an empty key" if isinstance(node, Scalar) else "a collection"
            raise ManifestError(
                f"{_path(stack)}: mapping keys must be names, got {got} (line {line})",
                where=source,
            )
        key = node.text
        if key in parent.entries:
            first = parent.key_lines[key]
            raise ManifestError(
                f"{_path(stack, key)}: duplicate key {key!r} (line {node.line}; "
                f"first at line {first})",
                where=source,
                hint="keep one of them",
            )
        parent.pending_key = (key, node.line)
        return
    key, key_line = parent.pending_key
    parent.entries[key] = node
    parent.key_lines[key] = key_line
    parent.pending_key = None


def _path(stack: list[_Open], key: str | None = None) -> str:
    """A readable key path for errors raised while building (``mesh``, ``rules[2]``)."""
    parts: list[str] = []
    for frame in stack[:-1]:
        if frame.kind == "map" and frame.pending_key is not None:
            parts.append(frame.pending_key[0])
        elif frame.kind == "seq":
            parts.append(f"[{len(frame.items)}]")
    if key is not None:
        parts.append(key)
    text = ".".join(parts).replace(".[", "[")
    return text or "<top>"
