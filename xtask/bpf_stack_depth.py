#!/usr/bin/env python3
"""Each BPF program's deepest call chain and its combined stack, from the object (llvm-objdump).

Kernels without the x86-64 BPF private stack (before 6.13: Debian 12's 6.1, the 6.12 LTS) reject a
program whose chain of calls, bpf_loop callbacks included, needs more than 512 bytes of stack in
all; 6.18 puts large frames on a private stack and adds up the others unrounded (it refused a
528-byte chain), so its verifier passes chains 6.1 refuses. This computes what 6.1's
verifier does: each function's stack is its deepest r10 offset, rounded up to 32 bytes per frame
(it matched 6.1's `combined stack size of 5 calls is 608` exactly).

Usage: python3 xtask/bpf_stack_depth.py target/release/build/profiler-daemon-*/out/profiler-ebpf [-v]
Exits 1 when a program is over 512 bytes.
"""
import re, subprocess, sys
obj = sys.argv[1]
dis = subprocess.run(["llvm-objdump", "-dr", obj], capture_output=True, text=True).stdout
funcs = {}   # name -> dict(depth, calls set, section, start)
cur = None; section = None
sec_funcs = {}  # section -> list of (start, name)
lines = dis.splitlines()
insns = []  # (func, pc, text, reloc)
for line in lines:
    m = re.match(r"Disassembly of section (\S+):", line)
    if m: section = m.group(1); continue
    m = re.match(r"([0-9a-f]+) <(.+)>:", line)
    if m:
        cur = m.group(2); funcs[cur] = dict(depth=0, calls=set(), section=section, start=int(m.group(1),16)//8)
        sec_funcs.setdefault(section, []).append((int(m.group(1),16)//8, cur)); continue
    m = re.match(r"\s+([0-9a-f]+):\s+((?:[0-9a-f]{2}\s){8})\s*(.*)", line)
    if m and cur:
        insns.append([cur, int(m.group(1),10), re.sub(r'^([0-9a-f]{2}\s)+', '', m.group(3)).strip(), None, section, m.group(2).split()]); continue
    m = re.match(r"\s+[0-9a-f]+:\s+(R_BPF_\S+)\s+(\S+)", line)
    if m and insns:
        insns[-1][3] = m.group(2)
def func_at(section, idx):
    best = None
    for start, name in sorted(sec_funcs.get(section, [])):
        if start <= idx: best = name
    return best
regs = {}
for f, pc, text, reloc, sec, raw in insns:
    d = funcs[f]
    for m in re.finditer(r"r10 - (0x[0-9a-f]+|\d+)", text):
        d["depth"] = max(d["depth"], int(m.group(1), 0))
    m = re.match(r"(r\d) = r10$", text)
    if m: regs[(f, m.group(1))] = True
    m = re.match(r"(r\d) \+= -(0x[0-9a-f]+|\d+)$", text)
    if m and regs.get((f, m.group(1))):
        d["depth"] = max(d["depth"], int(m.group(2), 0)); regs[(f, m.group(1))] = False
    m = re.match(r"call (-?0x[0-9a-f]+|-?\d+)$", text)
    if m:
        imm = int(m.group(1), 0)
        if reloc:
            if reloc in funcs: d["calls"].add(reloc)
            elif reloc.startswith("."): d["calls"].add(func_at(reloc, imm + 1))
        elif raw[0] == "85" and raw[1] == "10":
            d["calls"].add(func_at(sec, pc + imm + 1))
    if reloc and text.endswith(" ll") and raw[0] == "18":
        if reloc in funcs: d["calls"].add(reloc)
        elif reloc == ".text": d["calls"].add(func_at(".text", int(text.split("=")[1].split()[0], 0) // 8))
rnd = lambda x: (max(x, 1) + 31) // 32 * 32
def worst(f, seen=()):
    if f in seen: return 0, [f + "(recursion!)"]
    best = (0, [])
    for c in funcs[f]["calls"]:
        if c is None: continue
        w = worst(c, seen + (f,))
        if w[0] > best[0]: best = w
    return rnd(funcs[f]["depth"]) + best[0], [f"{f}:{funcs[f]['depth']}"] + best[1]
for f, d in sorted(funcs.items()):
    if d["section"] != ".text":
        total, chain = worst(f)
        print(f"{total:4} {'OK ' if total <= 512 else 'BIG'} {f}: {' > '.join(chain)}")
over = False
for f, d in funcs.items():
    if d["section"] != ".text" and worst(f)[0] > 512:
        over = True
if "-v" in sys.argv:
    for f, d in sorted(funcs.items()):
        print(f, d["depth"], sorted(x for x in d["calls"] if x))
sys.exit(1 if over else 0)
