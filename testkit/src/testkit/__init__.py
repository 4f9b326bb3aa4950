"""CPU engines that speak the real native protocols, with fault injection."""
