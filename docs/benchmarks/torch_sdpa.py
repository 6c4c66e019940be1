
import json, sys, time, statistics
import torch
import torch.nn.functional as F
spec = json.load(open(sys.argv[1]))
dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
for c in spec["cases"]:
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(c["b"], c["hq"], c["sq"], c["d"], generator=g) * 2 - 1).to(dt[c["dtype"]])
    k = (torch.rand(c["b"], c["hkv"], c["sk"], c["d"], generator=g) * 2 - 1).to(dt[c["dtype"]])
    v = (torch.rand(c["b"], c["hkv"], c["sk"], c["d"], generator=g) * 2 - 1).to(dt[c["dtype"]])
    kw = {"enable_gqa": c["hq"] != c["hkv"]}
    off = c["sk"] - c["sq"]
    if c["left"] is not None or c["right"] is not None:
        i = torch.arange(c["sq"]).unsqueeze(1) + off
        j = torch.arange(c["sk"]).unsqueeze(0)
        m = torch.ones(c["sq"], c["sk"], dtype=torch.bool)
        if c["left"] is not None:
            m &= j >= i - c["left"]
        if c["right"] is not None:
            m &= j <= i + c["right"]
        if c["sq"] == c["sk"] and c["left"] is None and c["right"] == 0:
            kw["is_causal"] = True
        else:
            kw["attn_mask"] = m
    for t in spec["threads"]:
        torch.set_num_threads(t)
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, **kw)
            times = []
            start = time.perf_counter()
            while len(times) < 10 and (len(times) < 3 or time.perf_counter() - start < spec["secs"]):
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, **kw)
                times.append(time.perf_counter() - t0)
        print(json.dumps({"case": c["name"], "threads": t, "median": statistics.median(times),
                          "min": min(times), "max": max(times)}), flush=True)
