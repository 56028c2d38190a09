"""What every command shares: options, the lazily opened admin API, output, exit codes.

Shared options go after the command name (`lmcache-remote stats --url ... --json`):
`--url` (envvar `LMCR_REMOTE_URL`), `--prefix` (envvar `LMCR_KEY_PREFIX`), `--config FILE`
(envvar `LMCR_CONFIG`), `--json`, `-v/--verbose` (repeatable), `-q/--quiet`. The configuration
is `load_config(FILE, remote_url=URL, key_prefix=PREFIX)`; the Redis connection opens on
first use, so `--help` and usage errors never touch the network.

Exit codes (`LmcrGroup.invoke` maps exceptions to them, always as one line on stderr, never
with a password in it): 0 ok, 1 error, 2 usage / bad configuration / refused, 3 Redis
unreachable or timing out, 130 interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from lmcache_remote.admin import CacheAdmin
from lmcache_remote.config import CacheConfig, load_config, mask_url
from lmcache_remote.errors import (
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    LmcrError,
)

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("lmcache_remote_cli")
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"]+")


def scrub(text: str) -> str:
    """One line, every URL in it with its password masked."""
    return " ".join(_URL_RE.sub(lambda m: mask_url(m.group(0)), str(text)).split())


class Refused(click.ClickException):
    """The command will not do what was asked (e.g. delete without --yes and no TTY)."""

    exit_code = EXIT_USAGE


@dataclasses.dataclass
class CliContext:
    url: str | None
    prefix: str | None
    config_file: str | None
    json: bool
    verbosity: int
    _admin: CacheAdmin | None = None

    @functools.cached_property
    def config(self) -> CacheConfig:
        overrides: dict[str, Any] = {}
        if self.url is not None:
            overrides["remote_url"] = self.url
        if self.prefix is not None:
            overrides["key_prefix"] = self.prefix
        config = load_config(self.config_file, **overrides)
        if config.remote_url is None:
            raise ConfigError("remote_url", "the CLI needs a Redis URL (--url or LMCR_REMOTE_URL)")
        return config

    @property
    def admin(self) -> CacheAdmin:
        if self._admin is None:
            self._admin = CacheAdmin(self.config)
            logger.info("Redis at %s, prefix %r", self._admin.url, self._admin.prefix)
        return self._admin

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()

    # -- output -------------------------------------------------------------------------------

    @functools.cached_property
    def out(self) -> Console:
        wide = None if sys.stdout.isatty() else 250  # pipes and files get whole rows
        return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=wide)

    @functools.cached_property
    def err(self) -> Console:
        return Console(file=sys.stderr, highlight=False)

    def emit(self, document: Any) -> None:
        """The one JSON document of a `--json` run, on stdout."""
        click.echo(json.dumps(document, sort_keys=False))

    def info(self, message: str) -> None:
        if self.verbosity >= 0:
            self.err.print(message)

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {message}")

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None = None,
                 unit: str = "items") -> Iterator[Callable[[int], None]]:
        """A progress bar on stderr (not with -q, nor when stderr is not a terminal); yields
        `advance(n)`."""
        if self.verbosity < 0 or not self.err.is_terminal:
            yield lambda n: None
            return
        columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is not None:
            columns.append(BarColumn())
        columns.append(DownloadColumn() if unit == "bytes" else MofNCompleteColumn())
        columns.append(TimeElapsedColumn())
        with Progress(*columns, console=self.err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)


def common_options(func: F) -> F:
    """Adds the shared options and passes a `CliContext` as the first argument."""

    @click.option("--url", envvar="LMCR_REMOTE_URL", help="Redis URL [env LMCR_REMOTE_URL].")
    @click.option("--prefix", envvar="LMCR_KEY_PREFIX",
                  help="Key prefix (default from config: lmcr) [env LMCR_KEY_PREFIX].")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False),
                  envvar="LMCR_CONFIG", help="YAML configuration file [env LMCR_CONFIG].")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
    @click.option("-v", "--verbose", count=True, help="More logging on stderr (repeatable).")
    @click.option("-q", "--quiet", is_flag=True, help="No progress bars or notes on stderr.")
    @functools.wraps(func)
    def wrapper(*args: Any, url: str | None, prefix: str | None, config_file: str | None,
                as_json: bool, verbose: int, quiet: bool, **kwargs: Any) -> Any:
        cx = CliContext(url, prefix, config_file, as_json, -1 if quiet else verbose)
        _setup_logging(cx.verbosity)
        click.get_current_context().call_on_close(cx.close)
        return func(cx, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class _StderrHandler(logging.Handler):
    """Writes to whatever `sys.stderr` is at the time (CliRunner swaps it), one line each."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(scrub(self.format(record)) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def _setup_logging(verbosity: int) -> None:
    """Library and CLI logs on stderr: warnings by default, -v info, -vv debug, -q errors."""
    levels = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}
    level = levels.get(verbosity, logging.DEBUG)
    for name in ("lmcache_remote", "lmcache_remote_cli"):
        log = logging.getLogger(name)
        log.setLevel(level)
        if not any(isinstance(h, _StderrHandler) for h in log.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            log.addHandler(handler)
            log.propagate = False


class LmcrGroup(click.Group):
    """A Click group that turns exceptions into the documented exit codes and one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except (BackendUnavailableError, BackendTimeoutError) as exc:
            click.echo(f"error: Redis unreachable: {scrub(str(exc))}", err=True)
            ctx.exit(EXIT_UNREACHABLE)
        except ConfigError as exc:
            click.echo(f"error: configuration: {scrub(str(exc))}", err=True)
            ctx.exit(EXIT_USAGE)
        except (LmcrError, OSError) as exc:
            click.echo(f"error: {scrub(str(exc))}", err=True)
            ctx.exit(EXIT_ERROR)
        except Exception as exc:
            if logging.getLogger("lmcache_remote").isEnabledFor(logging.DEBUG):
                raise
            click.echo(f"error: {type(exc).__name__}: {scrub(str(exc))}", err=True)
            ctx.exit(EXIT_ERROR)
