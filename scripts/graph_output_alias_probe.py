"""Probe (GPU): under mode="reduce-overhead", does a method returning a view of its argument or of a module tensor
keep eager's aliasing (writes after the call show through the view)? Prints one JSON line per case and mode.

usage: python3 scripts/graph_output_alias_probe.py CACHE_DIR
"""
import json
import sys

import torch

import gearcache


class Views(torch.nn.Module):
    def __init__(self, cache_dir=None, outputs="copy"):
        super().__init__()
        self.register_buffer("table", torch.arange(4., device="cuda"))
        if cache_dir is not None:
            config = gearcache.CompilerConfig(mode="reduce-overhead")
            config.inference_config.graph_outputs = outputs
            for name in ("arg_view", "state_view"):
                setattr(self, "c_" + name, gearcache.cache_compile(getattr(self, name), cache_dir=cache_dir,
                                                                   config=config))

    def arg_view(self, x):
        return x[1:], x * 2

    def state_view(self, x):
        return self.table[1:], x + 1


def main():
    for outputs in ("copy", "view"):
        m, e = Views(f"{sys.argv[1]}/{outputs}", outputs), Views()
        for name in ("arg_view", "state_view"):
            rows = []
            with torch.no_grad():
                for _ in range(3):
                    xm, xe = torch.arange(4., device="cuda") + 10, torch.arange(4., device="cuda") + 10
                    try:
                        om, oe = getattr(m, "c_" + name)(xm), getattr(e, name)(xe)
                    except Exception as exc:        # a refusal is a result here
                        rows.append(f"refused: {type(exc).__name__}: {str(exc)[:160]}")
                        continue
                    equal = torch.equal(om[0], oe[0])
                    xm.mul_(-1), xe.mul_(-1), m.table.add_(100), e.table.add_(100)
                    follows = torch.equal(om[0], oe[0])
                    rows.append({"equal": equal, "after writes": follows})
            print(json.dumps({"outputs": outputs, "case": name, "calls": rows}))


if __name__ == "__main__":
    main()
