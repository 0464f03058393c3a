"""python -m conformance.cli"""
from conformance.cli.commands import main

raise SystemExit(main())
