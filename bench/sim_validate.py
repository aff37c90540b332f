"""The simulator against our measured cold starts and multicast runs (issue 7, item 6).

Compares ``flashpoint.sim.validation``'s rows (see its docstring for what is calibrated
and what is predicted) and prints measured, simulated and their ratio; issue 7's bar is
within 10%. No flags; seconds to run. The last line is one JSON object.

    .venv/bin/python bench/sim_validate.py
"""

from __future__ import annotations

import json

from flashpoint.sim.validation import TOLERANCE, cold_start_tiers, multicast_modes


def main() -> None:
    rows = cold_start_tiers() + multicast_modes()
    print(f"{'case':<26} {'measured s':>11} {'simulated s':>12} {'ratio':>7} {'kind':>10}  within")
    for r in rows:
        kind = "calibrated" if r.calibrated else "predicted"
        print(f"{r.case:<26} {r.measured_s:>11.4f} {r.simulated_s:>12.4f} {r.ratio:>7.4f} "
              f"{kind:>10}  {'yes' if r.within else 'NO'}  {r.note}")
    predicted = [r for r in rows if not r.calibrated]
    print(json.dumps({
        "bench": "sim_validate", "tolerance": TOLERANCE,
        "all_within": all(r.within for r in rows),
        "worst_predicted_ratio": min((r.ratio for r in predicted), key=lambda x: -abs(x - 1)),
        "rows": [{"case": r.case, "measured_s": r.measured_s, "simulated_s": round(r.simulated_s, 4),
                  "ratio": round(r.ratio, 4), "calibrated": r.calibrated} for r in rows]}))


if __name__ == "__main__":
    main()
