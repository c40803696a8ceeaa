"""The control plane: typed messages and their codec, the rules they obey, subjects and NATS
permissions, the bus they travel on, and worker liveness. Never carries KV bytes."""
