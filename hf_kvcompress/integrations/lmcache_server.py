"""Run LMCache's multiprocess cache server with the ``hf_kvcompress`` serde registered.

LMCache finds serdes only in its in-process registry, so the server process must import
`hf_kvcompress.integrations.lmcache` before it parses ``--l2-adapter``. This launcher does that and then
runs LMCache's own server module with the remaining arguments::

    python -m hf_kvcompress.integrations.lmcache_server [--http] <lmcache server arguments>

``--http`` runs ``lmcache.v1.multiprocess.http_server`` (the server with its HTTP frontend) instead of
``lmcache.v1.multiprocess.server``.
"""

from __future__ import annotations

import runpy
import sys

SERVER, HTTP_SERVER = "lmcache.v1.multiprocess.server", "lmcache.v1.multiprocess.http_server"


def main(argv: list[str] | None = None) -> None:
    from . import lmcache  # noqa: F401  (registers the serde)

    args = list(sys.argv[1:] if argv is None else argv)
    module = SERVER
    if args[:1] == ["--http"]:
        module, args = HTTP_SERVER, args[1:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
