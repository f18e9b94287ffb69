"""The policy file's YAML, read with bounds: a deeply nested document or an alias bomb ("billion
laughs") is refused while composing, before anything is built from it. Pure: the caller passes the
text. `PolicyError` is the one error every policy problem raises (planner/policy.py)."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_POLICY_BYTES", "MAX_YAML_ALIASES", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "PolicyError",
           "load_policy_yaml"]


class PolicyError(ValueError):
    """An invalid policy; str() has one line per problem: `<source>: <key.path> = <value>: <why>`."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


# Bounds for the policy YAML (a policy is a few KiB): a deeply nested document or an alias bomb
# ("billion laughs") is refused while composing, before anything is built from it.
MAX_POLICY_BYTES = 256 * 1024
MAX_YAML_DEPTH = 32  # nesting levels, counted after alias expansion
MAX_YAML_ALIASES = 64
MAX_YAML_NODES = 100_000  # values (scalars, lists, mappings) as written and after alias expansion


class _YamlLimit(Exception):
    def __init__(self, line: int | None, problem: str) -> None:
        super().__init__(problem)
        self.line, self.problem = line, problem


def _line_of_mark(mark: Any) -> int | None:
    return mark.line + 1 if mark is not None else None


def _line(node_or_event: Any) -> int | None:
    return _line_of_mark(getattr(node_or_event, "start_mark", None))


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with a nesting limit and an alias budget (PyYAML's composer recurses per level)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _YamlLimit(_line(event), f"more than {MAX_YAML_ALIASES} aliases (*name)")
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _YamlLimit(_line(event), f"nested deeper than {MAX_YAML_DEPTH} levels")
            self._nodes += 1
            if self._nodes > MAX_YAML_NODES:
                raise _YamlLimit(_line(event), f"more than {MAX_YAML_NODES} values")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _node_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Size and depth of the document as built (aliases expanded), computed on the node graph with a
    memo, so that an alias bomb is measured without being expanded; a recursive alias is refused."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            children = _node_children(node)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > MAX_YAML_NODES:
                raise _YamlLimit(_line(node), f"expands to more than {MAX_YAML_NODES} values (alias bomb?)")
            if depth[key] > MAX_YAML_DEPTH:
                raise _YamlLimit(_line(node), f"nested deeper than {MAX_YAML_DEPTH} levels (through aliases)")
            continue
        if key in size:
            continue
        if key in on_path:
            raise _YamlLimit(_line(node), "an alias refers to a value that contains it (recursive alias)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _node_children(node) if id(c) not in size)


def _next_event_or_limit(parser: Any) -> bool:
    """parser.check_event(), with libyaml's own nesting limit (its scanner looks ahead and, since the
    libyaml bundled with PyYAML 6.0.3, refuses ~1,000 open levels before an event reaches us) reported
    as the same refusal as ours; any other YAMLError goes on to the caller."""
    try:
        return bool(parser.check_event())
    except yaml.YAMLError as exc:
        if "maximum nesting depth" not in str(getattr(exc, "problem", None) or exc):
            raise
        raise _YamlLimit(_line_of_mark(getattr(exc, "problem_mark", None)),
                         f"nested deeper than {MAX_YAML_DEPTH} levels") from None


def _prescan(text: str) -> int:
    """Bounds checked on libyaml's event stream (C: ~0.2 s for the largest file allowed) before any
    node is built: nesting, aliases and values as written. Same rules and lines as _BoundedLoader.
    Returns the number of aliases."""
    parser = yaml.CSafeLoader(text)
    try:
        open_collections = aliases = nodes = 0
        while _next_event_or_limit(parser):
            event = parser.get_event()
            if isinstance(event, yaml.CollectionEndEvent):
                open_collections -= 1
                continue
            if not isinstance(event, yaml.NodeEvent):
                continue  # stream and document start/end
            if isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_YAML_ALIASES:
                    raise _YamlLimit(_line(event), f"more than {MAX_YAML_ALIASES} aliases (*name)")
            if open_collections + 1 > MAX_YAML_DEPTH:
                raise _YamlLimit(_line(event), f"nested deeper than {MAX_YAML_DEPTH} levels")
            nodes += 1
            if nodes > MAX_YAML_NODES:
                raise _YamlLimit(_line(event), f"more than {MAX_YAML_NODES} values")
            if isinstance(event, yaml.CollectionStartEvent):
                open_collections += 1
        return aliases
    finally:
        parser.dispose()


def _compose(text: str) -> tuple[yaml.Node | None, Any, bool]:
    """(the document's node graph, a loader that can construct it, whether it has aliases), bounded as
    written; with aliases, the expanded document is measured after (_check_expansion). libyaml composes in C once the prescan has bounded the nesting
    (its composer recurses in C: unbounded input would overflow the C stack); without libyaml the
    pure-Python composer checks the same bounds as it goes (~30x slower)."""
    yaml.reader.Reader(text)  # PyYAML's character check, the same for both paths ("unacceptable character")
    aliases: int | None = None
    if getattr(yaml, "__with_libyaml__", False):
        aliases = _prescan(text)
        loader: Any = yaml.CSafeLoader(text)
    else:
        loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        return node, loader, (loader._aliases if aliases is None else aliases) > 0
    except BaseException:
        loader.dispose()
        raise


def load_policy_yaml(text: str, source: str) -> Any:
    """The YAML document of a policy as Python data, with bounds (size, nesting, aliases, values, as
    written and after alias expansion). Raises PolicyError naming the source, the line and the problem;
    nothing else escapes."""
    if len(text) > MAX_POLICY_BYTES:
        raise PolicyError(source, [f"(file) = {len(text)} characters: larger than the {MAX_POLICY_BYTES} limit"])
    loader: Any = None
    try:
        node, loader, has_aliases = _compose(text)
        if node is None:
            return None
        if has_aliases:  # without, the document as built is the document as written (bounded)
            _check_expansion(node)
        return loader.construct_document(node)
    except _YamlLimit as exc:
        where = f"line {exc.line}" if exc.line is not None else "(document)"
        raise PolicyError(source, [f"{where}: YAML refused: {exc.problem}"]) from None
    except yaml.YAMLError as exc:
        line = _line_of_mark(getattr(exc, "problem_mark", None))
        where = f"line {line}" if line is not None else "?"
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())[:200]  # one line
        raise PolicyError(source, [f"YAML syntax error at {where}: {problem}"]) from None
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:  # e.g. a bad timestamp scalar
        raise PolicyError(source, [f"(document): YAML not loadable: {type(exc).__name__}: {str(exc)[:200]}"]) from None
    finally:
        if loader is not None:
            loader.dispose()
