"""LightningDiT's latent statistics, transcribed as a test oracle.

Source: github.com/hustvl/LightningDiT, ``datasets/img_latent_dataset.py`` at commit
2725fed42a14898744433809949834e26957bcdd: ``ImgLatentDataset.get_img_to_safefile_map`` and
``ImgLatentDataset.compute_latent_stats`` with their signatures and defaults (the ``tqdm`` progress
bar and the ``print`` of the result left out; nothing else changed). ``__init__`` is shortened to
what these two read (``data_dir``, ``files``, ``img_to_file_map``). The files are LightningDiT's
extraction output: ``*.safetensors`` with ``latents`` (N, C, H, W) and ``labels`` (N,).
"""

import os
from glob import glob

import numpy as np
import torch
from safetensors import safe_open


class ImgLatentDataset:
    def __init__(self, data_dir, latent_norm=True, latent_multiplier=1.0):
        self.data_dir = data_dir
        self.latent_norm = latent_norm
        self.latent_multiplier = latent_multiplier

        self.files = sorted(glob(os.path.join(data_dir, "*.safetensors")))
        self.img_to_file_map = self.get_img_to_safefile_map()

    def get_img_to_safefile_map(self):
        img_to_file = {}
        for safe_file in self.files:
            with safe_open(safe_file, framework="pt", device="cpu") as f:
                labels = f.get_slice("labels")
                labels_shape = labels.get_shape()
                num_imgs = labels_shape[0]
                cur_len = len(img_to_file)
                for i in range(num_imgs):
                    img_to_file[cur_len + i] = {"safe_file": safe_file, "idx_in_file": i}
        return img_to_file

    def compute_latent_stats(self):
        num_samples = min(10000, len(self.img_to_file_map))
        random_indices = np.random.choice(len(self.img_to_file_map), num_samples, replace=False)
        latents = []
        for idx in random_indices:
            img_info = self.img_to_file_map[idx]
            safe_file, img_idx = img_info["safe_file"], img_info["idx_in_file"]
            with safe_open(safe_file, framework="pt", device="cpu") as f:
                features = f.get_slice("latents")
                feature = features[img_idx : img_idx + 1]
                latents.append(feature)
        latents = torch.cat(latents, dim=0)
        mean = latents.mean(dim=[0, 2, 3], keepdim=True)
        std = latents.std(dim=[0, 2, 3], keepdim=True)
        latent_stats = {"mean": mean, "std": std}
        return latent_stats
