"""The frozen app's entry script (PyInstaller runs this as __main__): the same as `strata-gui`."""
import multiprocessing
import sys

from strata_gui.app import main

if __name__ == "__main__":
    multiprocessing.freeze_support()  # a frozen child process must not start a second GUI
    sys.exit(main())
