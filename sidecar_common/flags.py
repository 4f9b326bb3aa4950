"""The flag library every console script shares: one-line usage errors, environment mirrors,
where each value came from, the rule for flags that do not apply, one ``--help`` style, and
the argument types more than one program reads.

Standard library (argparse) and the kernel's pure ``endpoint`` and ``programs`` modules only,
so that the testkit and the frontend use it without pulling in grpc. It is the one place that
touches argparse's private parts (its action table and action classes); programs use the
public helpers here instead.

- A usage error is one line on stderr, ``PROG: error: MESSAGE (see PROG --help)``, and exit
  2 (``EXIT_USAGE``); when the message names a flag whose value came from its environment
  variable, the line says which variable.
- With a prefix (``SIDECAR_``), every ``--foo-bar`` can also come from ``<prefix>FOO_BAR``: a
  flag beats its variable, a variable beats the default, and a bad value is a usage error
  naming the variable.
- A flag set (by the command line or its variable) where the chosen mode does not use it is
  refused (:func:`refuse_inapplicable`), never silently ignored.
- ``--help`` shows each flag's meaning, then ``(default: …)``, then ``[env VAR]``.
- Argument types: whole numbers, seconds, ports, listen addresses and bind hosts (parsed by
  :mod:`sidecar_common.endpoint`), and :func:`parsed_by` for any parser whose ValueError
  speaks to the user.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn, TypeVar

from sidecar_common.endpoint import HostPortError, HostPortWords, parse_bind_host, parse_host_port
from sidecar_common.programs import EXIT_USAGE

__all__ = [
    "FlagHelpFormatter",
    "FlagParser",
    "FlagSources",
    "annotate_env_help",
    "at_least_arg",
    "bind_host_arg",
    "env_var_for",
    "flag_sources",
    "formatter_for",
    "listen_arg",
    "parse_with_env",
    "parsed_by",
    "port_arg",
    "positive_int_arg",
    "refuse_inapplicable",
    "seconds_arg",
    "shown_default",
]

_T = TypeVar("_T")

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off", ""})
# Where parse_with_env leaves the FlagSources on the namespace it returns.
_SOURCES_ATTR: Final = "_flag_sources"
_NO_MEANING: Final = "\0"  # stands in for a missing help text while --help is formatted
_OPTION: Final = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def env_var_for(option: str, prefix: str) -> str:
    """``--grpc-endpoint`` -> ``SIDECAR_GRPC_ENDPOINT``."""
    return prefix + option.lstrip("-").replace("-", "_").upper()


# --- where values came from -------------------------------------------------------------------


@dataclass(frozen=True)
class FlagSources:
    """Which flags the command line set, which their variables set; the rest are defaults."""

    options: Mapping[str, str] = field(default_factory=dict)  # dest -> its first long option
    given: frozenset[str] = frozenset()  # dests set on the command line
    env: Mapping[str, str] = field(default_factory=dict)  # dest -> the variable that set it

    def is_set(self, dest: str) -> bool:
        return dest in self.given or dest in self.env

    def option(self, dest: str) -> str:
        return self.options.get(dest, "--" + dest.replace("_", "-"))

    def naming(self, dest: str) -> str:
        """``--flag``, or ``--flag comes from VAR`` when its variable set the value (the
        operator reading the command line would not find the flag there)."""
        option = self.option(dest)
        if dest in self.env and dest not in self.given:
            return f"{option} comes from {self.env[dest]}"
        return option

    def variables_named_in(self, message: str, parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
        """(option, variable) for each option ``message`` names whose value came from its
        environment variable, in the order named."""
        found: list[tuple[str, str]] = []
        for option in dict.fromkeys(_OPTION.findall(message)):
            action = parser._option_string_actions.get(option)
            if action is not None and action.dest in self.env and action.dest not in self.given:
                found.append((option, self.env[action.dest]))
        return found


def flag_sources(namespace: argparse.Namespace) -> FlagSources:
    """What :func:`parse_with_env` recorded (empty for a namespace built another way)."""
    sources = getattr(namespace, _SOURCES_ATTR, None)
    return sources if isinstance(sources, FlagSources) else FlagSources()


def refuse_inapplicable(namespace: argparse.Namespace, dest: str, *, applies: bool, rule: str) -> None:
    """The rule for a flag the chosen mode does not use: when it was set (on the command line
    or by its variable) and ``applies`` is false, a usage error ``--flag <rule>``. A default
    value never counts as set. Raises ValueError; the CLIs turn it into exit 2."""
    sources = flag_sources(namespace)
    if not applies and sources.is_set(dest):
        raise ValueError(f"{sources.option(dest)} {rule}")


# --- the parser and its help ------------------------------------------------------------------


def shown_default(default: object) -> str:
    """A default as ``--help`` shows it."""
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list | tuple | frozenset | set):
        return ",".join(map(str, default)) if default else "none"
    if isinstance(default, float) and default.is_integer():
        return f"{default:g}"
    return str(default)


class FlagHelpFormatter(argparse.HelpFormatter):
    """Each flag: its meaning, ``(default: …)`` (unless the text already says it, for a
    default that depends on something else), then ``[env VAR]`` when it has a mirror."""

    env_prefix: str | None = None

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings:
            # argparse shows nothing for a flag without help: still show its default and
            # variable (the --help test of the console scripts requires a meaning too).
            action = copy.copy(action)
            action.help = _NO_MEANING
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = "" if action.help == _NO_MEANING else (action.help or "").strip()
        if isinstance(action, argparse._HelpAction | argparse._VersionAction) or not action.option_strings:
            return text
        if "(default: " not in text:
            if action.nargs == 0:
                # A switch: its default is whether it is on.
                default = action.default if isinstance(action.default, bool) else None
                shown = "off" if default is None else shown_default(default)
            else:
                shown = shown_default(action.default)
            text = f"{text} (default: {shown.replace('%', '%%')})".lstrip()
        longs = [o for o in action.option_strings if o.startswith("--")]
        if self.env_prefix is not None and longs:
            text = f"{text} [env {env_var_for(longs[0], self.env_prefix)}]"
        return text


def formatter_for(prefix: str | None) -> type[FlagHelpFormatter]:
    return type("EnvFlagHelpFormatter", (FlagHelpFormatter,), {"env_prefix": prefix})


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (and name the variable a value
    came from), with the shared --help style. ``env_prefix`` turns on the mirrors' help."""

    def __init__(self, *args: Any, env_prefix: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", formatter_for(env_prefix))
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        self.flag_sources = FlagSources()

    def error(self, message: str) -> NoReturn:
        named = self.flag_sources.variables_named_in(message, self)
        if named:
            message += "; " + ", ".join(f"{option} comes from {var}" for option, var in named)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- argument types ---------------------------------------------------------------------------


def parsed_by(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """A flag type from a parser that refuses with a ValueError whose message is meant for
    the user (``parse_endpoint``, ``parse_etcd_endpoints``...): the refusal is a usage error
    in those words, naming the flag (or its variable), before anything touches the network."""

    def convert(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seconds_arg(*, allow_zero: bool) -> Callable[[str], float]:
    bound = ">= 0" if allow_zero else "> 0"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be a number of seconds {bound}, got {text}")
        return value

    convert.__name__ = "seconds"
    return convert


def at_least_arg(lowest: float, *, whole: bool = False) -> Callable[[str], float]:
    """A flag type: a finite number (an integer if ``whole``) of ``lowest`` or more."""
    kind = "a whole number" if whole else "a number"

    def convert(text: str) -> float:
        try:
            value: float = int(text) if whole else float(text)
        except ValueError:
            value = math.nan
        if not lowest <= value < math.inf:
            raise argparse.ArgumentTypeError(f"expected {kind} of {lowest:g} or more, got {text!r}")
        return value

    convert.__name__ = "number"
    return convert


def port_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


_LISTEN_WORDS: Final = HostPortWords(
    not_host_port="expected host:port, got {text!r}",
    brackets="unbalanced brackets in {text!r}",
    unbracketed_ipv6="an IPv6 host needs brackets, e.g. [::]:50061, got {text!r}",
    bad_host="not a host name or address: {detail!r}",
    bad_port="expected a numeric port, got {detail!r}",
    port_out_of_range="port must be in 0..65535, got {detail}",
)


def listen_arg(text: str) -> str:
    """A ``host:port`` to listen on (IPv6 in brackets; port 0 asks the OS for a free one),
    returned as :func:`~sidecar_common.endpoint.format_host_port` writes it."""
    try:
        return str(parse_host_port(text, port_zero_allowed=True))
    except HostPortError as err:
        raise argparse.ArgumentTypeError(_LISTEN_WORDS.message(err)) from None


def bind_host_arg(text: str) -> str:
    """A host name or address to bind (IPv6 with or without brackets), brackets removed."""
    try:
        return parse_bind_host(text)
    except HostPortError:
        raise argparse.ArgumentTypeError(f"not a host name or address: {text!r}") from None


# --- parsing with the environment -------------------------------------------------------------


class _Unset:
    """What a destination holds while no command-line flag has set it."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Final = _Unset()


def _collects(action: argparse.Action) -> bool:
    # Append and count actions build on what the namespace holds, which must then be None.
    return isinstance(action, argparse._AppendAction | argparse._AppendConstAction | argparse._CountAction)


def _optionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if action.option_strings
        and action.dest != argparse.SUPPRESS
        and not isinstance(action, argparse._HelpAction | argparse._VersionAction)
    ]


def _from_env(
    parser: argparse.ArgumentParser, action: argparse.Action, var: str, raw: str, default: Any
) -> Any:
    """The value an environment variable gives ``action`` (``default`` when it switches a
    flag off), or a usage error naming ``var``."""

    def refuse(problem: str) -> NoReturn:
        parser.error(f"environment variable {var}={raw!r}: {problem}")

    if action.nargs == 0:
        # store_true / store_false / store_const: the variable switches the flag on or off.
        word = raw.strip().lower()
        if word in _TRUE:
            return action.const
        if word in _FALSE:
            return default
        refuse("expected true/false, 1/0, yes/no or on/off")
    convert = action.type if callable(action.type) else str
    many = action.nargs in ("*", "+") or isinstance(action.nargs, int)
    words = raw.split() if many else [raw]
    values: list[Any] = []
    for word in words:
        try:
            value = convert(word)
        except argparse.ArgumentTypeError as err:
            refuse(str(err))
        except (TypeError, ValueError):
            refuse(f"invalid {getattr(convert, '__name__', 'value')} value")
        if action.choices is not None and value not in action.choices:
            refuse(f"invalid choice (choose from {', '.join(map(str, action.choices))})")
        values.append(value)
    if isinstance(action, argparse._AppendAction):
        return values
    return values if many else values[0]


def _default(parser: argparse.ArgumentParser, action: argparse.Action) -> Any:
    # As argparse itself does: a string default goes through the flag's type.
    if isinstance(action.default, str):
        return parser._get_value(action, action.default)
    return action.default


def parse_with_env(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    environ: Mapping[str, str],
    prefix: str | None,
) -> argparse.Namespace:
    """Parse ``argv``; with a ``prefix``, a flag no argument set takes its
    ``<prefix>FLAG_NAME`` variable. Records where each value came from (:func:`flag_sources`;
    a :class:`FlagParser`'s later usage errors name the variables too)."""
    optionals = _optionals(parser)
    env_vars: dict[str, list[tuple[argparse.Action, str, str]]] = {}
    if prefix is not None:
        for action in optionals:
            longs = list(_longs(action))
            if not longs:
                continue
            var = env_var_for(longs[0], prefix)
            raw = environ.get(var)
            if raw is not None:
                env_vars.setdefault(action.dest, []).append((action, var, raw))
                action.required = False  # the variable satisfies it
    # A namespace that already holds every destination: argparse then applies no default,
    # and whatever still holds the placeholder afterwards was not set on the command line.
    prefilled = argparse.Namespace(**{a.dest: None if _collects(a) else _UNSET for a in optionals})
    namespace = parser.parse_args(list(argv), namespace=prefilled)
    unset = {a.dest for a in optionals if getattr(namespace, a.dest) is (None if _collects(a) else _UNSET)}
    given = {a.dest for a in optionals} - unset
    from_env: dict[str, str] = {}
    for action in optionals:
        dest = action.dest
        if dest not in unset:
            continue
        unset.discard(dest)  # the first action of a shared destination decides, as in argparse
        default = value = _default(parser, action)
        for env_action, var, raw in env_vars.get(dest, ()):
            value = _from_env(parser, env_action, var, raw, default)
            # A switch its variable turns off (SIDECAR_X=false) is not a flag someone set.
            if env_action.nargs != 0 or value != default:
                from_env[dest] = var
        setattr(namespace, dest, value)
    options: dict[str, str] = {}
    for action in optionals:
        options.setdefault(action.dest, next(iter(_longs(action)), action.option_strings[0]))
    sources = FlagSources(options=options, given=frozenset(given), env=from_env)
    setattr(namespace, _SOURCES_ATTR, sources)
    if isinstance(parser, FlagParser):
        parser.flag_sources = sources
    return namespace


def _longs(action: argparse.Action) -> Iterable[str]:
    return (o for o in action.option_strings if o.startswith("--"))


def annotate_env_help(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Show each flag's environment variable (``<prefix>FLAG_NAME``) in --help."""
    if isinstance(parser, FlagParser):
        parser.env_prefix = prefix
    parser.formatter_class = formatter_for(prefix)
