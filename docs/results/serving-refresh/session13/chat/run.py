import json, sys, subprocess
sys.path.insert(0, "/work/main")
from dasc_server.spawn import running_server
out = []
for name, flags in [("nr, not parked", ["--load-policy", "nr", "--no-park-finished"]),
                    ("wr, not parked", ["--load-policy", "wr", "--no-park-finished"]),
                    ("wr, parked (default)", ["--load-policy", "wr"])]:
    with running_server("--wmax", "128", "--checkpoint-interval", "256", *flags) as s:
        cmd = [sys.executable, "-m", "loadgen.cli", "--base-url", s.base_url, "--workload", "multi-turn",
               "--with-replies", "--num-groups", "24", "--prompts-per-group", "5", "--prefix-len", "512",
               "--suffix-len", "64", "--max-tokens", "8", "--concurrency", "32", "--seed", "42",
               "--no-progress", "--output", f"/tmp/chat/{name.split(',')[0]}-{'park' if 'default' in name else 'nopark'}.jsonl"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd="/work/main")
        st = s.stats()["counters"]
        summ = json.loads(open(cmd[-1]).read().splitlines()[-1])["summary"]
        row = {"arm": name, "hit": summ["cache_hit_rate"], "mean_ttft_ms": summ["mean_ttft_ms"],
               "mean_tpot_ms": summ.get("mean_tpot_ms"), "duration_s": summ["duration"],
               "failed": summ["failed"], "parked_hits": st["parked_hits"], "loads_nr": st["loads_nr"],
               "loads_wr": st["loads_wr"], "refresh_tokens": st["refresh_tokens"]}
        print(json.dumps(row), flush=True); out.append(row)
json.dump(out, open("/tmp/chat/summary.json", "w"), indent=1)
