"""Models written the way users write them, for tests/models/check_export.py: each is exported
with `python3 -m vramscope.export tests/models/export_models.py:NAME` and its saved-for-backward
bytes compared with PyTorch's."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A residual block: functional ReLU, one activation module called twice, `out += identity`,
    and a strided 1x1 shortcut when the shape changes."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.act = nn.ReLU(inplace=True)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.shortcut is not None:
            identity = self.shortcut(x)
        out += identity
        return self.act(out)


class Mixed(nn.Module):
    """Inception-style branches joined by torch.cat, then a functional relu, scaled."""

    def __init__(self, c):
        super().__init__()
        self.a = nn.Conv2d(c, c // 2, 1)
        self.b = nn.Sequential(nn.Conv2d(c, c // 4, 1), nn.ReLU(), nn.Conv2d(c // 4, c // 2, 3, padding=1))

    def forward(self, x):
        return F.relu(torch.cat([self.a(x), self.b(x)], dim=1)) * 0.5


class ResidualCNN(nn.Module):
    """A custom residual CNN for 32x32 images with a frozen stem."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True))
        self.stem.requires_grad_(False)
        self.stage1 = nn.Sequential(Block(32, 32), Block(32, 32))
        self.mixed = Mixed(32)
        self.stage2 = nn.Sequential(Block(32, 64, stride=2), Block(64, 64))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.stage1(x)
        x = self.mixed(x)
        x = self.stage2(x)
        x = torch.flatten(self.pool(x), 1)
        return self.fc(self.drop(x))


class EncoderLayer(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim, heads, hidden, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Dropout(dropout))

    def forward(self, x):
        h = self.ln1(x)
        h, _ = self.attn(h, h, h, need_weights=False)
        x = x + h
        return x + self.mlp(self.ln2(x))


class SmallTransformer(nn.Module):
    """A small language model over token ids: embedding, learned positions, two blocks, a head."""

    def __init__(self, vocab=100, seq=32, dim=64, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.blocks = nn.Sequential(*[EncoderLayer(dim, heads, 4 * dim, 0.1) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos
        return self.head(self.ln(self.blocks(x)))


class MeanCNN(nn.Module):
    """A small CNN whose global average pool is written as x.mean((2, 3)) (a Mean layer)."""

    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def forum_cnn():
    """The PyTorch forum user's regression CNN (the zoo's forum-cnn)."""
    return nn.Sequential(
        nn.Conv2d(20, 50, 3, padding=1), nn.ReLU(),
        nn.Conv2d(50, 25, 3, padding=1), nn.ReLU(),
        nn.Conv2d(25, 10, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(4180, 3258))
