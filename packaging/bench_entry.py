"""The frozen console program's entry script (PyInstaller runs this as __main__): `strata-bench`."""
import multiprocessing
import sys

from engine.cli.bench import main

if __name__ == "__main__":
    multiprocessing.freeze_support()  # a frozen child process must not run the CLI again
    sys.exit(main())
