"""python -m conformance.native.conventions"""
from conformance.native.conventions.survey import main

raise SystemExit(main())
