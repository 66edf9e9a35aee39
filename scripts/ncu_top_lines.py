"""Top source lines by stall samples from `ncu --page source --csv --print-source cuda` output."""
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
# find header row
hi = next(i for i, r in enumerate(rows) if any("Source" == c or "Source" in c for c in r) and len(r) > 4)
h = rows[hi]
print("columns:", h[:30])
samp = [i for i, c in enumerate(h) if "Sampling" in c and "All" in c] or [i for i, c in enumerate(h) if "Sampling" in c]
src = next(i for i, c in enumerate(h) if c.strip() in ("Source", "# Source") or c.endswith("Source"))
line = 0
data = []
for r in rows[hi + 1:]:
    if len(r) <= max(samp + [src]):
        continue
    try:
        v = float(r[samp[0]] or 0)
    except ValueError:
        continue
    data.append((v, r[0], r[src].strip()[:110]))
tot = sum(d[0] for d in data) or 1
print("total samples", tot)
for v, ln, s in sorted(data, reverse=True)[:45]:
    print(f"{100*v/tot:5.1f}% L{ln:>5s} {s}")
