"""The release of this package, in one place: `lmcache_remote.__version__` re-exports it, and
code inside the package that needs it (the start-up line) imports it from here, not from the
package, so no module imports the package that imports it. pyproject.toml holds the same
string (`version`); tests/test_docs.py checks they agree."""

__version__ = "0.1.0"
