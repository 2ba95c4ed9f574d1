"""Engine checkpoint formats (readers and writers), one module or subpackage per engine."""
