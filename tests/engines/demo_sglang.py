"""`make demo-sglang`: SGLang prefill/decode disaggregation through pdxfer, on this
machine's CPU, in about a minute and a half.

    python -m tests.engines.demo_sglang [--keep]

A prefill and a decode ``sgl.Engine`` (SGLang 0.5.23, the test model of `model.py`,
`sglang_pd`'s CPU settings), each in its own process beside its own ``pdxfer serve``
daemon, ``--disaggregation-transfer-backend pdxfer`` on both, get ten requests in two
waves (`prompts.standard_waves`: chunked sends, a shared prefix the decode's radix cache
holds in the second wave); one plain engine gets the same prompts. Per request: the
decode's tokens beside the plain engine's, the KV the prefill sent (the pages after
what the decode's cache held), and the hand-off, from the prefill handing its last
chunk to pdxfer to the decode streaming the first token. Then all the decode daemon
received. Exits 1 if any request's tokens differ."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from tests.engines import sglang_pd
from tests.engines.model import write_model_dir
from tests.engines.prompts import standard_waves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engines.demo_sglang", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory (engine and daemon logs)")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="pdxfer-demo-sglang-")
    waves = standard_waves()
    try:
        model_dir = write_model_dir(os.path.join(workdir, "model"))
        print("starting a plain SGLang engine for the reference tokens ...", flush=True)
        expected = sglang_pd.generate_single(model_dir, os.path.join(workdir, "single"), waves)
        print("starting a prefill and a decode SGLang engine, each beside a pdxfer daemon ...", flush=True)
        pair = sglang_pd.generate_pdxfer(model_dir, workdir, waves, plugins=(*sglang_pd.BASELINE_PLUGINS, "decode_log"))
    finally:
        if args.keep:
            print(f"logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    run, matched, total = pair.run, 0, 0
    page_bytes = sum(run.kvargs["prefill-0.json"]["kv_item_lens"])  # one page of every K and V buffer
    print(f"\n{'wave':>4} {'prompt':>6} {'KV sent':>10} {'hand-off':>9}  decode through pdxfer / plain engine")
    for w, (wave, rooms) in enumerate(zip(waves, run.rooms)):
        for i, (req, room) in enumerate(zip(wave, rooms)):
            got, want = run.tokens[w][i], expected[w][i]
            handoff = run.handoff_seconds(room)
            total += 1
            matched += got == want
            kv = sum(c["pages"] for c in run.calls_for(room, "send")) * page_bytes
            print(f"{w:>4} {len(req.input_ids):>6} {kv / 1024:6.0f} KiB {'-' if handoff is None else f'{1000 * handoff:6.1f} ms':>9}  "
                  f"{got}\n{'':34}{want}  {'same' if got == want else 'DIFFERENT'}")
    kv = pair.received["bytes_received"]
    print(f"\nKV moved: the decode daemon received {kv:,.0f} bytes ({kv / 2**20:.2f} MiB: KV pages and each room's aux record) "
          f"in {pair.received['rooms_succeeded']:.0f} rooms, {pair.received['rooms_failed']:.0f} failed")
    print(f"tokens: {matched} of {total} requests match the plain engine" + ("" if matched == total else " -- MISMATCH"))
    return 0 if matched == total and pair.exit_codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
