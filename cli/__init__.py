"""The `lmcache-remote` command line: a thin Click layer over the library."""
