"""The only code of checkpoint-io that knows bytes: files, index, manifest, DCP's storage."""
