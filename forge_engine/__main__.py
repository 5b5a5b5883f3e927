from forge_engine.cli import main

if __name__ == "__main__":  # not when a spawned process (a tensor-parallel worker) imports this module
    raise SystemExit(main())
