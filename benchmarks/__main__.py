from benchmarks.cli import lab_parser
from dlo_fn.cli import entry

if __name__ == "__main__":
    entry(lab_parser())
