import httpx, time, random, sys, json, concurrent.futures as cf
port=int(sys.argv[1]); n=int(sys.argv[2]); reps=int(sys.argv[3])
def one(seed):
    rng=random.Random(seed); p=[rng.randrange(3,256) for _ in range(n)]
    t=time.perf_counter(); times=[]
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={"prompt":p,"max_tokens":16,"temperature":0,"stream":True,"ignore_eos":True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                times.append(time.perf_counter()-t)
    return times
for rep in range(reps):
    httpx.post(f"http://127.0.0.1:{port}/flush_cache", timeout=60)
    base=random.randrange(10**9)
    with cf.ThreadPoolExecutor(2) as ex:
        res=list(ex.map(one, [base, base+1]))
    out=[dict(ttft=round(t[0],3), first_gap=round(t[1]-t[0],3), end=round(t[-1],3)) for t in res]
    print(json.dumps(out), flush=True)
