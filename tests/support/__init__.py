"""What several test files share: builders of tiny configs, models and rollouts, and the programs
the tests start (a command-line run, a GCS emulator, a headless browser, a multi-process worker).
A test file imports from here, never from another test file (tests/test_golden.py excepted: its
recorded runs are what other files compare with)."""
