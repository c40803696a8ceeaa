"""What prefill, decode and colocated workers share: settings, start-up and announcements."""
