"""What every ardit process shares that is not part of the wire contract: settings loading, logging."""
