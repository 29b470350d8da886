from dlo_fn.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
