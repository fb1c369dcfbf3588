"""Songs given as links: the link file in the inbox and its download (yt-dlp)."""
