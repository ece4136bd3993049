"""The descriptor pool the generated Triton modules register in: their own, not protobuf's default.

tritonclient ships its own generated copies of the same .proto files (other revisions, the same
message names); both registering `inference.ModelConfig` in the default pool would fail in any
process that imports both (a test, a user's client). Messages are the same on the wire either way.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
