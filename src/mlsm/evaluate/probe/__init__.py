"""The probe of a latent checkpoint (k -> |V|) and the readout controls, fitted to a held-out
plateau or through the training loop; scoring text through them."""
