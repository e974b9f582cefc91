"""tf_memguard's command line.

    python -m tf_memguard report report.json
    python -m tf_memguard what-if report.json --budget 8GiB [--batch-size 512 ...]

`report` prints a run's memory report (written by Report.to_json, e.g. by
examples/train_under_budget.py). `what-if` asks the run's memory model whether batch sizes
would fit another budget, and which is the largest that does: a run on a laptop sizes a
job for a bigger machine of the same kind (the model holds for the same framework, model
and data layout; memory outside the budget, such as TensorFlow's scratch buffers, is not in it).
"""
import argparse
import sys

from tf_memguard._units import HELP, format_bytes, parse_bytes


def _budget(text):
    try:
        return parse_bytes(text, 0, name="--budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tf_memguard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="print a run's memory report")
    rep.add_argument("report", help="a report written by Report.to_json")
    wi = sub.add_parser("what-if", help="would batch sizes fit another budget?")
    wi.add_argument("report", help="a report written by Report.to_json")
    wi.add_argument("--budget", required=True, type=_budget,
                    help=f"the budget to ask about: {HELP} (a fraction is not: it would be of this machine)")
    wi.add_argument("--batch-size", type=int, action="append", default=None,
                    help="a batch size to tabulate (repeatable). Defaults to powers of two around the run's.")
    args = ap.parse_args(argv)

    from tf_memguard._advice import format_what_if, what_if
    from tf_memguard._report import Report
    try:
        report = Report.from_json(args.report)
    except (OSError, ValueError, TypeError) as e:
        ap.error(f"{args.report}: not a tf_memguard report ({e})")
    if args.command == "report":
        print(report)
        return 0
    model = report.model()
    if model is None:
        ap.error(f"{args.report}: the run recorded no memory model (MemGuardCallback with advice=True, "
                 "a batch size known, and at least one training step)")
    if any(b <= 0 for b in args.batch_size or []):
        ap.error("--batch-size: must be positive")
    rows, largest = what_if(model, args.budget, sizes=args.batch_size, at_most=report.samples)
    print(f"{args.report}: {report.device}, recorded at batch size {report.batch_size} under "
          f"{format_bytes(report.budget_bytes) if report.budget_bytes else 'no budget'}")
    print(format_what_if(rows, largest, args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
