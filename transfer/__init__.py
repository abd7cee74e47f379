"""KV transfer: transceiver, sender/receiver, formatter, connections and transfer agents."""
