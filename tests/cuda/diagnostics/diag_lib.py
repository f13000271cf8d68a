import collections
import json
import os
import tempfile

from remat_plugin.capture.memory_meter import memory_profile


def live_at_peak(fn, DEV):
    with memory_profile(cuda=DEV == "cuda") as prof:
        fn()
    return live_at_peak_in(prof, DEV)


def live_at_peak_in(prof, DEV):
    """(peak, op at the peak, bytes live at the peak by allocating op, largest live blocks) of a finished session."""
    kind = 1 if DEV == "cuda" else 0
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "t.json"); prof.export_chrome_trace(p); tr = json.load(open(p))["traceEvents"]
    ops = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("tid")) for e in tr if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    mem = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"], e.get("tid")) for e in tr if e.get("name") == "[memory]" and e["args"].get("Device Type") == kind)
    live, cur, peak, at, snap = {}, 0, 0, None, {}
    def owner(ts, tid):
        best = None
        for s, e, n, t in ops:
            if s <= ts <= e and t == tid and (best is None or s >= best[0]): best = (s, n)
        return best[1] if best else "?"
    for ts, b, addr, tid in mem:
        if b > 0: live[addr] = (b, ts, tid)
        elif addr in live: live.pop(addr)
        else: continue
        cur += b
        if cur > peak: peak, at, snap = cur, (ts, tid), dict(live)
    by = collections.Counter()
    for addr, (b, ts, tid) in snap.items(): by[owner(ts, tid)] += b
    top = sorted(((round(b / 2**20, 3), owner(ts, tid), "fw" if tid == at[1] else "other-thread") for b, ts, tid in snap.values()), reverse=True)[:10]
    return peak, owner(*at), by.most_common(12), top
