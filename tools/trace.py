"""Save a running server's trace as Chrome trace-event JSON, for chrome://tracing or
ui.perfetto.dev: the last seconds of every process, or one request's path across them.

    python -m tools.trace URL [-o FILE] [--request-id ID] [--seconds N] [--api-key KEY]
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request


def main(argv: list[str] | None = None, prog: str = "python -m tools.trace") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("-o", "--output", default="troupe-trace.json", help="where to write it ('-': stdout)")
    p.add_argument("--request-id", help="only this request (its response id or X-Request-Id)")
    p.add_argument("--seconds", type=float, default=None, help="how far back (at most 60)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    args = p.parse_args(argv)
    query = {k: v for k, v in (("request_id", args.request_id), ("seconds", args.seconds)) if v is not None}
    url = args.url.rstrip("/") + "/debug/trace" + ("?" + urllib.parse.urlencode(query) if query else "")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        print(f"troupe-trace: error: {exc.code} from {url}: {detail}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"troupe-trace: error: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    trace = json.loads(body)
    if args.output == "-":
        sys.stdout.write(body.decode())
    else:
        with open(args.output, "wb") as f:
            f.write(body)
        print(f"wrote {len(trace['traceEvents'])} events to {args.output} (open it in ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
